"""A model's shortlist: the part of the vocabulary its logits stand for, column by column."""
import numpy as np
import torch

from decode.tensors import on


class Shortlist:
    """The tokens a model's logits stand for, column by column, when they are a part of the vocabulary: a
    draft's most frequent training tokens (FR-Spec, Zhao et al. 2025), whose output layer then costs that part
    of the whole. What a draft proposes is then among them; what is accepted is the oracle's either way."""

    def __init__(self, tokens, vocab_size: int):
        self.tokens = np.unique(np.asarray(tokens, np.int64))  # column -> token, ascending
        self.column = np.full(vocab_size, -1, np.int64)  # token -> column, -1 off the list
        self.column[self.tokens] = np.arange(len(self.tokens))
        self.on_device: dict[torch.device, torch.Tensor] = {}

    @classmethod
    def most_frequent(cls, counts: np.ndarray, size: int) -> "Shortlist":
        """The `size` tokens counted most often (ties: the lower id)."""
        return cls(np.argsort(-counts, kind="stable")[:size], len(counts))

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def vocab_size(self) -> int:
        return len(self.column)

    def tokens_on(self, device: torch.device) -> torch.Tensor:
        """The tokens, column by column, as a tensor on `device` (made once per device)."""
        if device not in self.on_device:
            self.on_device[device] = on(torch.from_numpy(self.tokens), device)
        return self.on_device[device]

    def tokens_at(self, columns: torch.Tensor) -> torch.Tensor:
        """The tokens of these columns, a tensor on the columns' device."""
        return self.tokens_on(columns.device)[columns]

    def widen(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits over the whole vocabulary from logits over the shortlist: -inf off it."""
        wide = logits.new_full((*logits.shape[:-1], self.vocab_size), float("-inf"))
        wide[..., self.tokens_on(logits.device)] = logits
        return wide
