"""A completion's text as its tokens grow, decoded a few tokens at a time, and how much of it is settled.

Streaming a completion, or checking it for stop strings, needs its text after every oracle call. Decoding the
whole completion each time costs a step time that grows with its length (quadratic over the completion). Here each
call that extends the previous call's tokens decodes only a window: the tokens added since the last committed text,
after the tokens committed before them. The text the new tokens add is the window's text past its context's text,
as in vLLM's and text-generation-inference's detokenizers; starting both decodes at the same token keeps decoders
that treat a text's first token apart (SentencePiece's leading space) the same as in the whole text. Where the
window's text does not extend its context's, the call decodes the whole completion instead, and the next one tries
the window again. Tokenizers whose decoders do more than turn each token into its text and join them (WordPiece's
spaces between words and their clean-up) are decoded whole at every call.

A stream may send only text that no later token can change: not a character still incomplete at the end (U+FFFD
until its last byte arrives); with SentencePiece's byte tokens (<0x0A>, ...), not the run of them at the end, because
a run that is not valid UTF-8 decodes to U+FFFD throughout, its valid bytes too; and where a decoder cleans up the
spaces around words ("x ' y" reads "x'y"), not the last token's text.
"""
import functools
import json
import re
from collections.abc import Callable, Collection

from decode.healing import Prompt


class CompletionText:
    """`prompt.completion(tokenizer, tokens, stop_ids)` for growing `tokens`, decoding only what each call adds; a
    call whose tokens do not extend the last call's (a shorter prefix, another list) is decoded whole."""

    def __init__(self, prompt: Prompt, tokenizer, stop_ids: Collection[int]):
        self.prompt, self.tokenizer, self.stop_ids = prompt, tokenizer, stop_ids
        self.windowed, self.byte_tokens, self.decode = decoding(tokenizer)
        self.tokens: list[int] = []  # the tokens last decoded (windowed: by the last call that extended them)
        self.ids: list[int] = []  # those of them that have text (not stop tokens)
        self.committed = ""  # the text of ids[:read]
        self.start = self.read = 0  # ids[start:read]: the context decoded again before the tokens past it
        self.context: str | None = None  # its text, once decoded
        self.last = ""  # their text

    def __call__(self, tokens: list[int]) -> str:
        """The text the tokens add to the prompt (Prompt.completion's)."""
        return self.text(tokens)[len(self.prompt.tail) :]

    def settled(self, tokens: list[int]) -> int:
        """How much of `self(tokens)` no token after them can change: all but an incomplete character at its end, the
        run of byte tokens at its end, and, where the decoder cleans up spaces around words, the last token's text."""
        text, held = self.text(tokens), self.held_back(tokens)
        if held:
            text = self.prefix(tokens, held)
        return max(0, len(text.rstrip("\ufffd")) - len(self.prompt.tail))

    def held_back(self, tokens: list[int]) -> int:
        """How many of the last tokens that have text a later token may decode otherwise."""
        texts = (t for t in reversed(tokens) if t not in self.stop_ids)
        if not self.windowed:
            return 1 if next(texts, None) is not None else 0
        run = 0
        for t in texts:
            if t not in self.byte_tokens:
                break
            run += 1
        return run

    def text(self, tokens: list[int]) -> str:
        """The whole text of the tokens (before the healed tail is taken off)."""
        seen = len(self.tokens)
        if not self.windowed:  # whole, once a list of tokens (settled asks again)
            if tokens != self.tokens:
                self.tokens, self.last = list(tokens), self.whole(tokens)
            return self.last
        if len(tokens) < seen or tokens[:seen] != self.tokens:
            return self.whole(tokens)
        if len(tokens) == seen and seen:
            return self.last
        self.ids += [t for t in tokens[seen:] if t not in self.stop_ids]
        self.tokens += tokens[seen:]
        added = self.past_context(len(self.ids))
        if added is None:
            self.last = self.whole(tokens)
            return self.last
        self.last = self.committed + added
        if added and not added.endswith("\ufffd") and self.ids[-1] not in self.byte_tokens:
            # settled at its end: the next window starts here
            self.committed, self.start, self.read, self.context = self.last, self.read, len(self.ids), None
        return self.last

    def prefix(self, tokens: list[int], run: int) -> str:
        """The whole text of the tokens before the last `run` of those that have text, which `text(tokens)` read."""
        end = len(self.ids) - run
        if self.windowed and tokens == self.tokens and end >= self.read:
            added = self.past_context(end)
            if added is not None:
                return self.committed + added
        kept, ids = run, list(tokens)
        while kept:  # drop the run, and the stop tokens among it
            kept -= ids.pop() not in self.stop_ids
        return self.whole(ids)

    def past_context(self, end: int) -> str | None:
        """The text of ids[read:end] after the context's (None: the window's text does not start with the context's)."""
        if self.context is None:
            self.context = self.decode(self.ids[self.start : self.read])
        window = self.decode(self.ids[self.start : end])
        return window[len(self.context) :] if window.startswith(self.context) else None

    def whole(self, tokens: list[int]) -> str:
        return self.prompt.tail + self.prompt.completion(self.tokenizer, tokens, self.stop_ids)


# tokenizers' decoders that turn each token into text on its own and join the texts: byte-level BPE's, and
# SentencePiece's ("▁" for a space, byte tokens fused into characters, the text's first space dropped)
JOINING_DECODERS = frozenset({"ByteLevel", "Metaspace", "Replace", "ByteFallback", "Fuse", "Strip"})
BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


@functools.lru_cache(maxsize=16)
def decoding(tokenizer) -> tuple[bool, frozenset[int], Callable[[list[int]], str]]:
    """Whether a window of the tokenizer's tokens decodes as it does in the whole text (a fast tokenizer whose
    decoders all join, with transformers' clean-up of spaces off); its byte tokens where its decoder reads them as
    bytes (ByteFallback); and what decodes a window: the tokenizers library's own decode where transformers' class
    adds nothing to it (its per-call overhead outweighs a window's few tokens), else the tokenizer's."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or backend.decoder is None:
        return False, frozenset(), tokenizer.decode
    from transformers import PreTrainedTokenizerFast

    state = json.loads(backend.decoder.__getstate__())
    kinds = {d["type"] for d in state.get("decoders", [state])}
    windowed = kinds <= JOINING_DECODERS and not getattr(tokenizer, "clean_up_tokenization_spaces", True)
    generic = windowed and type(tokenizer)._decode is PreTrainedTokenizerFast._decode
    decode = functools.partial(backend.decode, skip_special_tokens=False) if generic else tokenizer.decode
    if "ByteFallback" not in kinds:
        return windowed, frozenset(), decode
    return windowed, frozenset(i for piece, i in backend.get_vocab().items() if BYTE_TOKEN.fullmatch(piece)), decode
