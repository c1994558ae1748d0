"""OpenAI's stop sequences over a completion's text as it streams."""


class StopText:
    """OpenAI's stop sequences on streamed text: the text before the first stop string, with the tail that could
    still begin one held back until it cannot. Each piece costs time in its own length and the stop strings' only:
    a new match ends in the new piece, so the search starts len(stop) - 1 characters before it, and the tail held
    back is found by Knuth, Morris and Pratt's automaton over the text's last len(stop) - 1 characters."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops, self.text, self.shown, self.stopped = stops, "", 0, False
        self.longest = max((len(s) for s in stops), default=0)
        self.borders = [borders(s) for s in stops]

    def feed(self, piece: str) -> str:
        """The newly visible text after `piece`."""
        start = max(0, len(self.text) - self.longest + 1)  # where a match that ends in `piece` can begin
        self.text += piece
        found = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
        if found:
            end, self.stopped = min(found), True
        else:
            end = len(self.text) - max((self.begun(s, b) for s, b in zip(self.stops, self.borders)), default=0)
        new, self.shown = self.text[self.shown : max(end, self.shown)], max(end, self.shown)
        return new

    def begun(self, stop: str, border: list[int]) -> int:
        """The length of the longest proper prefix of `stop` that the text ends with."""
        state = 0
        for c in self.text[max(0, len(self.text) - len(stop) + 1) :]:
            while state and stop[state] != c:
                state = border[state - 1]
            state += stop[state] == c
        return state

    def flush(self) -> str:
        """The held-back tail, once the text is complete and no stop string came."""
        if self.stopped:
            return ""
        new, self.shown = self.text[self.shown :], len(self.text)
        return new


def borders(stop: str) -> list[int]:
    """Knuth, Morris and Pratt's prefix function: for each i, the longest proper prefix of stop[: i + 1] that is also
    its suffix."""
    border = [0] * len(stop)
    for i in range(1, len(stop)):
        k = border[i - 1]
        while k and stop[i] != stop[k]:
            k = border[k - 1]
        border[i] = k + (stop[i] == stop[k])
    return border
