"""A KV cache of slots: `length` committed positions, then `pending` speculative ones that a tree's nodes fill and a
commit keeps or drops."""
from collections.abc import Callable

import torch

from decode.errors import InputError
from decode.native import tensor_field


class KVSlots:
    """Keys and values of every layer in one (2, layers, heads, capacity, head_dim) tensor (keys at [0], values at
    [1]): one copy writes or moves both. `reserve` takes slots for new nodes after the pending ones; `commit` keeps an
    ordered subset of the pending slots (an accepted path) right after the committed ones and drops the rest, by the
    runtime's moves (decode.models.runtime: `mover(cache)`)."""

    def __init__(self, layers: int, heads: int, head_dim: int, capacity: int, dtype: torch.dtype, device: torch.device,
                 mover: Callable[[torch.Tensor], Callable[[int, list[int]], None]]):
        self.cache = torch.zeros((2, layers, heads, capacity, head_dim), device=device, dtype=dtype)
        self.field = tensor_field(self.cache)  # as the C++ forward reads it, found once (after a forward, slowly)
        self.layers = self.cache.unbind(1)  # views, one per layer: indexing them parses one index fewer
        self.capacity = capacity
        self.length = 0  # committed positions
        self.pending = 0  # speculative positions after them
        self.move = mover(self.cache)

    def fresh(self, mover: Callable[[torch.Tensor], Callable[[int, list[int]], None]], capacity: int | None = None
              ) -> "KVSlots":
        """An empty cache of this one's shape (of `capacity` slots where given), dtype and device."""
        _, layers, heads, own, head_dim = self.cache.shape
        return KVSlots(layers, heads, head_dim, capacity or own, self.cache.dtype, self.cache.device, mover)

    def reserve(self, q: int) -> tuple[int, int]:
        """The slots start..end for q new nodes, after the pending ones."""
        start = self.length + self.pending
        if start + q > self.capacity:
            raise InputError(f"{q} new nodes after {start} cached slots overflow the cache of {self.capacity} slots; "
                             f"draft smaller trees (--budget, --widths)")
        return start, start + q

    def commit(self, keep: list[int]) -> None:
        """Pending slot keep[i] becomes committed position length + i; the other pending slots are dropped."""
        self.move(self.length, keep)
        self.length += len(keep)
        self.pending = 0
