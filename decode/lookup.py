"""Drafts from the context itself: the tokens that followed the latest earlier occurrences of the
sequence's current suffix (prompt-lookup decoding; llama.cpp's lookup modes). Code repeats its
identifiers, its signature and the words of its docstring, so what the context already holds is
the cheapest good draft.
"""
from decode import native


class ContextIndex:
    """Where each n-gram (n = 1..max_ngram) of a growing sequence occurred, built incrementally: one
    dictionary update per new token and order, one lookup per order when drafting."""

    def __init__(self, max_ngram: int = 3):
        self.max_ngram = max_ngram
        self.reset()

    def reset(self) -> None:
        self.ends = {}  # n-gram -> the positions right after its occurrences, in order
        self.indexed = 1  # occurrences ending before this position are indexed

    def update(self, tokens: list[int]) -> None:
        """Index the occurrences that a token follows (`tokens` only ever grows between resets)."""
        for end in range(self.indexed, len(tokens)):
            for n in range(1, min(self.max_ngram, end) + 1):
                self.ends.setdefault(tuple(tokens[end - n : end]), []).append(end)
        self.indexed = max(self.indexed, len(tokens))

    def continuations(self, tokens: list[int], length: int, branches: int = 1) -> list[list[int]]:
        """Up to `branches` different continuations of `length` tokens that followed the longest suffix
        of `tokens` seen before, the latest occurrence first. A continuation that runs into the end of
        the sequence goes on with its own tokens: the text repeats with the period it just showed. With the step's
        C++ loops, a scan of the sequence finds the same (decode/native_step.cpp; updating the index in Python cost
        more than the scan)."""
        if native.module() is not None:
            return native.continuations(tokens, self.max_ngram, length, branches)
        self.update(tokens)
        for n in range(min(self.max_ngram, len(tokens) - 1), 0, -1):
            chains = []
            for end in reversed(self.ends.get(tuple(tokens[-n:]), ())):
                chain = tokens[end : end + length]
                while len(chain) < length:  # `end` lies within `length` of the end: repeat the period
                    chain.append(chain[len(chain) - (len(tokens) - end)])
                if chain not in chains:
                    chains.append(chain)
                    if len(chains) == branches:
                        break
            if chains:
                return chains
        return []
