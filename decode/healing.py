"""Token healing: the prompt's last token is backed off, and the first generated token must extend its text.

Byte-level BPE merges a newline with the indentation after it ("\\n    " is one token), so a prompt
that ends in a bare "\\n" token puts the models where training never took them: in the corpus, a
newline before an indented line is part of a longer token. Backing the last token off and allowing
as first token only those whose text starts with the text it held makes the boundary canonical
(transformers calls this token healing). Every method applies the same constraint to the oracle's
first distribution, so outputs stay exact: the first token follows the oracle's distribution
conditioned on extending the prompt's text, and everything after it the oracle's own.
"""
from collections.abc import Collection
from dataclasses import dataclass

import torch


@dataclass
class Prompt:
    ids: torch.Tensor  # what the models are fed
    tail: str = ""  # the text backed off: the completion's first token starts with it
    allowed: torch.Tensor | None = None  # (vocab,) bool: the first tokens that extend `tail`; None: any

    def completion(self, tokenizer, tokens: list[int], stop_ids: Collection[int]) -> str:
        """The text the new tokens add to the prompt, without the tokens that ended it (the healed tail is the
        prompt's, not theirs)."""
        return tokenizer.decode([t for t in tokens if t not in stop_ids])[len(self.tail) :]


class TokenHealer:
    """Turns prompt token ids into a Prompt, healed or (with `enabled=False`) as given."""

    def __init__(self, tokenizer, vocab_size: int, enabled: bool = True):
        self.tokenizer, self.vocab_size, self.enabled = tokenizer, vocab_size, enabled
        special = set(tokenizer.all_special_ids)
        # Byte-level pieces: one character per byte, so a text prefix is a piece prefix.
        pieces = tokenizer.convert_ids_to_tokens(list(range(min(len(tokenizer), vocab_size))))
        self.pieces = [None if i in special else piece for i, piece in enumerate(pieces)]
        self._allowed: dict[int, torch.Tensor] = {}

    def allowed(self, token: int) -> torch.Tensor:
        """(vocab,) bool: the tokens whose text starts with `token`'s (`token` among them)."""
        if token not in self._allowed:
            tail = self.pieces[token]
            mask = torch.zeros(self.vocab_size, dtype=torch.bool)
            mask[[i for i, piece in enumerate(self.pieces) if piece is not None and piece.startswith(tail)]] = True
            self._allowed[token] = mask
        return self._allowed[token]

    def __call__(self, ids: list[int], device="cpu") -> Prompt:
        """Heal when the last token's text is a whole suffix of the prompt's: not a special token, not part
        of a character, and the tokenizer's text is the concatenation of its tokens' (byte-level BPE;
        a word-level tokenizer joins words with spaces, and then nothing is backed off)."""
        if self.enabled and len(ids) > 1 and ids[-1] < len(self.pieces) and self.pieces[ids[-1]] is not None:
            head, tail = self.tokenizer.decode(ids[:-1]), self.tokenizer.decode(ids[-1:])
            if tail and "\ufffd" not in tail and self.tokenizer.decode(ids) == head + tail:
                return Prompt(torch.tensor(ids[:-1], device=device), tail, self.allowed(ids[-1]).to(device))
        return Prompt(torch.tensor(ids, device=device))


def constrain_first(logits: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
    """Logits whose first row gives only `allowed` tokens any probability (a copy; None: unchanged)."""
    if allowed is None:
        return logits
    logits = logits.clone()
    logits[0].masked_fill_(~allowed, float("-inf"))
    return logits
