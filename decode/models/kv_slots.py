"""A KV cache of slots: `length` committed positions, then `pending` speculative ones that a tree's nodes fill and a
commit keeps or drops."""
import torch

from decode.errors import InputError
from decode import native


class KVSlots:
    """Keys and values of every layer in one (2, layers, heads, capacity, head_dim) tensor (keys at [0], values at
    [1]): one copy writes or moves both. `reserve` takes slots for new nodes after the pending ones; `commit` keeps an
    ordered subset of the pending slots (an accepted path) right after the committed ones and drops the rest."""

    def __init__(self, layers: int, heads: int, head_dim: int, capacity: int, dtype: torch.dtype, device: torch.device):
        self.cache = torch.zeros((2, layers, heads, capacity, head_dim), device=device, dtype=dtype)
        self.layers = self.cache.unbind(1)  # views, one per layer: indexing them parses one index fewer
        self.capacity = capacity
        self.length = 0  # committed positions
        self.pending = 0  # speculative positions after them
        # a commit's moves in C++ on a CPU: right after a forward, the cpu preset's oracle's torch copies (`move`) took
        # 60-90 us a commit of 4 moved slots, the C++ 20-40 (its 96 planes' lines are out of the caches by then)
        self.mover = native.slot_mover(self.cache)

    def reserve(self, q: int) -> tuple[int, int]:
        """The slots start..end for q new nodes, after the pending ones."""
        start = self.length + self.pending
        if start + q > self.capacity:
            raise InputError(f"{q} new nodes after {start} cached slots overflow the cache of {self.capacity} slots; "
                             f"draft smaller trees (--budget, --widths)")
        return start, start + q

    def commit(self, keep: list[int]) -> None:
        """Pending slot keep[i] becomes committed position length + i; the other pending slots are dropped."""
        if self.mover is not None:
            self.mover(self.length, keep)
        else:
            self.move(keep)
        self.length += len(keep)
        self.pending = 0

    def move(self, keep: list[int]) -> None:
        """Pending slot keep[i] to slot length + i, by torch copies. Slots already in place stay: drafters put a
        tree's likeliest path first (Tree.subtree), so an accepted path is often all in place, and the rest of it,
        numbered depth first, holds runs of consecutive slots. Each run is copied as one block, split where it would
        overlap its destination. Right after a forward, copying slot by slot is faster than one index_select of the
        slots (95-105 against 145-185 us a commit of the cpu preset's oracle), and blocks cut the copies further."""
        n = len(keep)
        start = next((i for i, slot in enumerate(keep) if slot != i), n)
        while start < n:
            end = start + 1
            while end < n and keep[end] == keep[end - 1] + 1 and end < keep[start]:
                end += 1
            self.cache.narrow(3, self.length + start, end - start).copy_(
                self.cache.narrow(3, self.length + keep[start], end - start))
            start = end
