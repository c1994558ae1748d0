"""The draft model's KV cache during a step: which pending slot holds which tree node.

A drafter that uses the draft model keeps its KV cache on the accepted prefix. Each step begins
with the accepted tokens the draft has not seen (the oracle's last token, the root, among them);
the step's first forward feeds them together with the first tree nodes, so a staged step costs one
draft call. `accept` commits them and the accepted nodes the draft scored.
"""
from collections.abc import Callable
from typing import NamedTuple

import torch

from decode.models.cached_lm import CachedLM, ChainCall
from decode.sampling import Sampling, Uniforms
from decode.tree import Tree, rows_mask


def remember(memo: dict, key, make: Callable, size: int):
    """memo[key], made once by `make()`; a memo that holds `size` entries is emptied first."""
    if key not in memo:
        if len(memo) >= size:
            memo.clear()
        memo[key] = make()
    return memo[key]


class Call(NamedTuple):
    """One draft forward's bookkeeping (DraftCache.layout): the tree nodes it feeds after the unseen tokens, each one's
    pending slot and the slots it sees (as bits), the attention mask (None: causal), each fed token's position past
    the cache, and how many rows of logits it returns (None: all)."""
    new: list[int]
    slots: dict[int, int]
    sees: dict[int, int]
    mask: torch.Tensor | None
    offsets: list[int]
    rows: int | None


class DraftCache:
    """The draft model's cache bookkeeping for one step: which pending slot holds which tree node."""

    def __init__(self, model: CachedLM):
        self.model = model
        self.shortlist = model.shortlist  # the tokens of the draft's logits' columns (None: every token)
        self.calls = 0
        self.slots: dict[int, int] = {}
        self.known: dict[tuple, Call] = {}  # (a call's `repeats` key, unseen tokens, pending slots) -> its Call

    def reset(self) -> None:
        self.model.reset()
        self.calls = 0

    def start(self, tokens: list[int]) -> None:
        """A new step: the accepted tokens past the draft's cache, the root last, are fed with the first score."""
        self.unseen = tokens[self.model.length :]
        self.slots = {}  # tree node -> pending slot
        self.sees: dict[int, int] = {}  # tree node -> the pending slots it attends to, as bits

    def score(self, tree: Tree, nodes: list[int], repeats=None) -> torch.Tensor:
        """Logits after each of `nodes`, in one forward pass. Their ancestors must be scored already or
        among them; the step's first call scores the root (node 0, first in `nodes`) with the unseen accepted tokens.
        A drafter whose steps repeat the same calls on trees of one shape names each call's place (`repeats`, any
        hashable key): its slots, mask and positions are then worked out once per number of unseen tokens (on a CPU
        this runs cold, right after the draft's previous forward)."""
        model, pending = self.model, self.model.pending
        run = self.unseen if not self.slots else []
        if run and nodes[0] != 0:
            raise ValueError("a step's first draft call scores the root first")
        if repeats is None:
            call = self.layout(tree, nodes, len(run), pending)
        else:
            call = remember(self.known, (repeats, len(run), pending), lambda: self.layout(tree, nodes, len(run), pending),
                            1 << 12)
        self.slots.update(call.slots)
        self.sees.update(call.sees)
        self.calls += 1
        ids = run + [tree.tokens[n] for n in call.new]
        length = model.length
        positions = [length + offset for offset in call.offsets]
        return model.forward(ids, positions, call.mask, call.rows)  # row i: after nodes[i]

    def chain_call(self, steps: int, sampling: Sampling, generator: Uniforms) -> ChainCall | None:
        """A step's `steps` draft calls down a chain from the root (each scoring the node the one before chose, the
        first with the unseen accepted tokens) as one call of the model's, where it has one (CachedLM.chains); else
        None, and the caller scores node by node. When sampling, the call draws at the generator's next `steps`
        uniforms. Once run (alone, or beside other sequences' chains), `chained` keeps its nodes."""
        if self.slots or not self.model.chains(len(self.unseen), sampling):
            return None
        run, length = self.unseen, self.model.length
        uniforms = [] if sampling.greedy else generator.take(steps)
        return ChainCall(self.model, run, list(range(length, length + len(run))), steps, sampling, uniforms)

    def chained(self, call: ChainCall, chosen: tuple[list[int], list | None]) -> tuple[list[int], list | None]:
        """The chain's tokens below the root (greedy: the argmaxes; sampling: draws) and, when sampling, each one's
        distribution, as score's logits give them, from what the call gave; node i of the chain is then scored, in
        pending slot i past the root's."""
        root = len(call.token_ids) - 1
        self.slots = {node: root + node for node in range(call.steps)}
        self.sees = {node: (2 << slot) - 1 for node, slot in self.slots.items()}
        self.calls += call.steps
        return chosen

    def layout(self, tree: Tree, nodes: list[int], unseen: int, pending: int) -> Call:
        """`score`'s bookkeeping for a call with `unseen` accepted tokens to feed first (0 after a step's first call)."""
        rows = [(2 << i) - 1 for i in range(unseen)]  # the unseen tokens: a causal chain (nothing is pending yet)
        slots, sees = {}, {}
        if unseen:
            slots[0], sees[0] = unseen - 1, rows[-1]
        new = [n for n in nodes if n != 0]
        for slot, node in enumerate(new, pending + unseen):
            slots[node] = slot
            parent = tree.parents[node]
            sees[node] = (sees[parent] if parent in sees else self.sees[parent]) | 1 << slot
            rows.append(sees[node])
        mask = None  # every row sees every slot up to its own (a chain): the model's causal default
        if any(bits != (2 << slot) - 1 for slot, bits in enumerate(rows, pending)):
            mask = rows_mask(tuple(rows), pending + len(rows), self.model.device)
        root = slots[0] if unseen else self.slots[0]  # the root's position, past the cache
        offsets = list(range(unseen)) + [root + tree.depths[n] for n in new]
        first = unseen - 1 if unseen else 0  # the unseen tokens before the root (a prompt, at first) need no logits
        return Call(new, slots, sees, mask, offsets, len(rows) - first if first else None)

    def accept(self, tree_path: list[int]) -> None:
        """Commit the unseen tokens and the accepted nodes the draft has scored (a prefix of the path)."""
        if not self.slots:
            return
        keep = list(range(self.slots[0] + 1))
        for node in tree_path[1:]:
            if node not in self.slots:
                break
            keep.append(self.slots[node])
        self.model.commit(keep)
