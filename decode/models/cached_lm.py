"""The interface every backend offers the decoders: a causal LM with a KV cache of `length`
committed positions followed by `pending` speculative ones.

    forward(token_ids, position_ids, mask[, last]) -> logits   score new nodes, append them as pending
    commit(keep)                                               keep these pending slots (increasing), in order; drop the rest
    chain(token_ids, position_ids, steps, sampling, uniforms) -> (tokens, distributions)
                                                               a chain drafter's forwards as one call, where
                                                               chains(rows, sampling) says the backend has one
    fork()                                                     the same model with a cache of its own
    cache_bytes()                                              the memory its cache takes

A decoding loop asks its oracle for each forward as a `Call`, which `run` performs alone and decode.batch together
with other sequences' calls; a chain drafter asks its draft model for a chain as a `ChainCall`, the same way.
"""
from dataclasses import dataclass

import torch

from decode.models.runtime import Runtime
from decode.sampling import Sampling, Sparse
from decode.shortlist import Shortlist
from decode.tensors import Ids


@dataclass
class Call:
    """A forward a decoding loop asks of a model: over new nodes kept pending (`forward`'s arguments) or, with
    `extend`, over a run of tokens after everything cached, committed at once (no positions nor mask)."""

    token_ids: Ids
    position_ids: Ids | None = None
    mask: torch.Tensor | None = None
    last: int | None = None
    extend: bool = False


@dataclass
class ChainCall:
    """A chain of forwards a drafter asks of its draft model (`chain`'s arguments), which `run` performs alone and
    decode.batch together with other sequences' chains."""

    model: "CachedLM"
    token_ids: Ids
    position_ids: Ids
    steps: int
    sampling: Sampling
    uniforms: list[float]

    def run(self) -> tuple[list[int], list[Sparse] | None]:
        return self.model.chain(self.token_ids, self.position_ids, self.steps, self.sampling, self.uniforms)


class CachedLM:
    length: int = 0
    pending: int = 0
    max_length: int
    vocab_size: int
    device: torch.device
    dtype: torch.dtype  # the weights' (logits are float32 either way)
    runtime: Runtime  # what runs it on its device: its forward's ways, the step's loops over its logits
    shortlist: Shortlist | None = None  # forward's logits cover these tokens only (None: the whole vocabulary)

    def forward(self, token_ids: Ids, position_ids: Ids, mask: torch.Tensor | None,
                last: int | None = None) -> torch.Tensor:
        """Float32 logits (q, vocab) of q new nodes, their tokens and positions given as tensors or lists (with a
        shortlist, (q, len(shortlist))). Every committed
        position is visible to them; `mask` (q, pending + q) marks which pending slots and new nodes each one
        sees (None: all of them, the new nodes as a causal chain). With `last`, the logits of the last `last`
        nodes only (0: none): reading a prompt needs its last row at most, and the output layer over every row
        of a long prompt costs as much as a small model's layers."""
        raise NotImplementedError

    def commit(self, keep: list[int]) -> None:
        raise NotImplementedError

    def chains(self, rows: int, sampling) -> bool:
        """Whether `chain` runs here for a first forward of `rows` nodes under this sampling setting."""
        return False

    def chain(self, token_ids: Ids, position_ids: Ids, steps: int, sampling, uniforms: list[float]
              ) -> tuple[list[int], list[Sparse] | None]:
        """`steps` forwards down a chain, appended as pending: the first over the new nodes (the last of them a
        tree's root), each later one over the token chosen after the one before, a position further: greedy, each
        row's argmax; under a top-k setting, a draw at each of `uniforms` from its processed distribution. Returns the
        tokens and, when sampling, their distributions. The tokens and distributions a
        chain drafter gets from `forward` one call at a time; only where `chains` says so."""
        raise NotImplementedError

    def reset(self) -> None:
        self.length = self.pending = 0

    def fork(self, slots: int | None = None) -> "CachedLM":
        """The same model (its weights shared, not copied) with an empty cache of its own, on which another sequence
        decodes while this one keeps its own; with `slots`, room past the context for that many speculative nodes
        at once (None: as much as this model has)."""
        raise NotImplementedError

    def speculative_slots(self) -> int | None:
        """The speculative nodes its cache holds past the context at once (None: no limit)."""
        return None

    @property
    def runs_together(self) -> bool:
        """Whether its forks' forwards run as one forward (decode.models.together)."""
        return False

    def pieces(self, call: Call) -> list[Call]:
        """The calls that together do what `call` does, each run as one forward (decode.batch runs one a step): a
        long prompt's extend as the chunks `run` reads it in, the logits of each joined in turn; else the call."""
        return [call]

    def cache_bytes(self) -> int:
        """The bytes its cache holds now (a preallocated cache's, whatever it holds)."""
        return 0

    def run(self, call: Call) -> torch.Tensor:
        """A call's logits, its forward run alone."""
        if call.extend:
            return self.extend(torch.as_tensor(call.token_ids, device=self.device), call.last)
        assert call.position_ids is not None  # a forward's Call gives them
        return self.forward(call.token_ids, call.position_ids, call.mask, call.last)

    def append(self, token_ids: torch.Tensor, last: int | None = None) -> torch.Tensor:
        """Score a run of tokens after everything cached, keeping them pending (the logits of the `last` only)."""
        start = self.length + self.pending
        positions = torch.arange(start, start + token_ids.numel(), device=self.device)
        return self.forward(token_ids, positions, None, last)

    def extend(self, token_ids: torch.Tensor, last: int | None = None) -> torch.Tensor:
        """Score a run of tokens after everything cached and commit all pending slots (the logits of the `last` only)."""
        logits = self.append(token_ids, last)
        self.length += self.pending  # every pending slot is kept where it is
        self.pending = 0
        return logits

    def extend_whole(self, token_ids: torch.Tensor) -> torch.Tensor:
        """`extend`, its logits over the whole vocabulary even with a shortlist (-inf off it): for measurements."""
        logits = self.extend(token_ids)
        return logits if self.shortlist is None else self.shortlist.widen(logits)
