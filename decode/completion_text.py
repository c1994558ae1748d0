"""A completion's text as its tokens grow, decoded a few tokens at a time.

Streaming a completion, or checking it for stop strings, needs its text after every oracle call. Decoding the
whole completion each time costs a step time that grows with its length (quadratic over the completion). Here each
call that extends the previous call's tokens decodes only a window: the tokens added since the last committed text,
after the tokens committed before them. The text the new tokens add is the window's text past its context's text,
as in vLLM's and text-generation-inference's detokenizers; starting both decodes at the same token keeps decoders
that treat a text's first token apart (SentencePiece's leading space) and a character split across tokens (U+FFFD
until its last byte arrives) the same as in the whole text. Where the window's text does not extend its context's
(SentencePiece's byte tokens: a run of them decodes to U+FFFD throughout while a character in it is incomplete), the
call decodes the whole completion instead, and the next one tries the window again. Tokenizers whose decoders do
more than turn each token into its text and join them (WordPiece's spaces between words and their clean-up) are
decoded whole at every call.
"""
import functools
import json
from collections.abc import Collection

from decode.healing import Prompt


class CompletionText:
    """`prompt.completion(tokenizer, tokens, stop_ids)` for growing `tokens`, decoding only what each call adds; a
    call whose tokens do not extend the last call's (a shorter prefix, another list) is decoded whole."""

    def __init__(self, prompt: Prompt, tokenizer, stop_ids: Collection[int]):
        self.prompt, self.tokenizer, self.stop_ids = prompt, tokenizer, stop_ids
        self.tokens: list[int] = []  # the last call's tokens
        self.ids: list[int] = []  # those of them that have text (not stop tokens)
        self.committed = ""  # the text of ids[:read]
        self.start = self.read = 0  # ids[start:read]: the context decoded again before the tokens past it
        self.last = ""  # the last call's answer
        self.windowed = windowed(tokenizer)

    def __call__(self, tokens: list[int]) -> str:
        seen = len(self.tokens)
        if not self.windowed or len(tokens) < seen or tokens[:seen] != self.tokens:
            return self.prompt.completion(self.tokenizer, tokens, self.stop_ids)
        if len(tokens) == seen and seen:
            return self.last
        self.ids += [t for t in tokens[seen:] if t not in self.stop_ids]
        self.tokens = list(tokens)
        context = self.tokenizer.decode(self.ids[self.start : self.read])
        window = self.tokenizer.decode(self.ids[self.start :])
        if not window.startswith(context):
            self.last = self.prompt.completion(self.tokenizer, tokens, self.stop_ids)
            return self.last
        added = window[len(context) :]
        text = self.committed + added
        if added and not added.endswith("\ufffd"):  # a whole character at its end: the next window starts here
            self.committed, self.start, self.read = text, self.read, len(self.ids)
        self.last = text[len(self.prompt.tail) :]
        return self.last


# tokenizers' decoders that turn each token into text on its own and join the texts: byte-level BPE's, and
# SentencePiece's ("▁" for a space, byte tokens fused into characters, the text's first space dropped)
JOINING_DECODERS = frozenset({"ByteLevel", "Metaspace", "Replace", "ByteFallback", "Fuse", "Strip"})


@functools.lru_cache(maxsize=16)
def windowed(tokenizer) -> bool:
    """Whether a window of the tokenizer's tokens decodes as they do in the whole text: a fast tokenizer whose
    decoders are all joining ones, with transformers' clean-up of spaces off."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or backend.decoder is None or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return False
    state = json.loads(backend.decoder.__getstate__())
    return {d["type"] for d in state.get("decoders", [state])} <= JOINING_DECODERS
