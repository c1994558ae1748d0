"""The interface every backend offers the decoders: a causal LM with a KV cache of `length`
committed positions followed by `pending` speculative ones.

    forward(token_ids, position_ids, mask) -> logits   score new nodes, append them as pending
    commit(keep)                                        keep these pending slots (increasing), in order; drop the rest
"""
import numpy as np
import torch


def on(tensor: torch.Tensor, device) -> torch.Tensor:
    """`tensor` (on the CPU) moved to `device`, without a call when it is the CPU: a torch call right
    after a model's forward costs tens of microseconds on a CPU (its code and data were evicted)."""
    return tensor if device is None or getattr(device, "type", device) == "cpu" else tensor.to(device)


def long_tensor(values: list[int], device=None) -> torch.Tensor:
    """A 1-d int64 tensor from a list of ints: through numpy it costs a quarter of torch.tensor's
    4-5 us, and a decoding step makes several."""
    return on(torch.from_numpy(np.array(values, np.int64)), device)


class CachedLM:
    length: int = 0
    pending: int = 0
    max_length: int
    vocab_size: int
    device: torch.device

    def forward(self, token_ids: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """Float32 logits (q, vocab) of q new nodes. Every committed position is visible to them; `mask`
        (q, pending + q) marks which pending slots and new nodes each one sees (None: all of them, the
        new nodes as a causal chain)."""
        raise NotImplementedError

    def commit(self, keep: list[int]) -> None:
        raise NotImplementedError

    def reset(self) -> None:
        self.length = self.pending = 0

    def append(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Score a run of tokens after everything cached, keeping them pending."""
        start = self.length + self.pending
        positions = torch.arange(start, start + token_ids.numel(), device=self.device)
        return self.forward(token_ids, positions, None)

    def extend(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Score a run of tokens after everything cached and commit all pending slots."""
        logits = self.append(token_ids)
        self.length += self.pending  # every pending slot is kept where it is
        self.pending = 0
        return logits
