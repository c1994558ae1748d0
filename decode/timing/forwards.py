"""Timing a model's forward: `forward_costs` times one forward of q chained nodes after a cached prefix (the costs
the planner sizes trees from, and the choices calibration makes), `host_work_after_forward` what a forward does to the
host work after it."""
import time
from typing import TYPE_CHECKING

import numpy as np
import torch

from decode.tree import Tree

if TYPE_CHECKING:
    from decode.models.cached_lm import CachedLM

NODE_COUNTS = (1, 2, 4, 8, 16, 32, 64)
# Untimed forwards of a count before its timed ones, at least this long: right after forwards of many nodes (a
# prompt's, or a larger count's), the next few forwards of one node ran up to 2x slower on a CPU for some milliseconds
SETTLE_SECONDS = 0.01


def bushy_tree(q: int) -> Tree:
    """q nodes, three children per node, level by level: the shape of a drafted tree."""
    tree = Tree.rooted(0)
    for node in range(1, q):
        tree.add((node - 1) // 3, node)
    return tree


def prefill(model: "CachedLM", prefix: int) -> int:
    """An empty cache filled with `prefix` random tokens, committed; returns `prefix`."""
    model.reset()
    model.extend(torch.randint(0, model.vocab_size, (prefix,), device=model.device), last=0)
    return prefix


def forward_costs(model: "CachedLM", prefix: int = 128, repeats: int = 20, counts=NODE_COUNTS,
                  tree: bool = False, rounds: int = 4) -> dict[int, float]:
    """Milliseconds per forward of q nodes after `prefix` cached positions (at most half the context;
    median of repeats). The nodes form a chain, the costliest shape for attention, with the model's
    default causal mask; with `tree=True` a three-children-per-node tree with its explicit mask (to
    compare the two). Positions stop at the context's end (a tree's nodes share positions, so a tree
    can hold more nodes than the context has positions). The repeats are split among `rounds` that each
    time every count in turn, a count's forwards one after another, as a decoding loop repeats its own: a
    burst of other work on the machine slows a part of a count's forwards, which the median drops, rather
    than all of them. Each count's timed forwards follow SETTLE_SECONDS of untimed ones."""
    prefix = prefill(model, min(prefix, model.max_length // 2))
    forwards = {}  # q -> (ids, positions, mask)
    for q in (q for q in counts if prefix + q <= getattr(model, "capacity", model.max_length)):
        ids = torch.randint(0, model.vocab_size, (q,)).tolist()  # as decoding passes them: lists
        positions, mask = [min(position, model.max_length - 1) for position in range(prefix, prefix + q)], None
        if tree:
            shape = bushy_tree(q)
            positions, mask = shape.positions(prefix), shape.mask(model.device)
        forwards[q] = ids, positions, mask

    def seconds(q: int) -> float:
        model.runtime.synchronize()
        start = time.perf_counter()
        model.forward(*forwards[q])
        model.runtime.synchronize()
        took = time.perf_counter() - start
        model.commit([])
        return took

    times: dict[int, list[float]] = {q: [] for q in forwards}
    for round_ in range(rounds):
        for q in forwards:
            settled = time.perf_counter() + SETTLE_SECONDS
            seconds(q)
            while time.perf_counter() < settled:
                seconds(q)
            times[q] += [seconds(q) for _ in range(repeats * (round_ + 1) // rounds - repeats * round_ // rounds)]
    model.reset()
    return {q: 1e3 * float(np.median(timed)) for q, timed in times.items()}


def host_work_after_forward(model: "CachedLM", prefix: int = 128, repeats: int = 50) -> dict[str, float]:
    """Microseconds of a fixed piece of host work of the kind a decoding step does between forwards (a loop
    of Python over 200 items, a numpy gather of 64 values from a (32, 4096) array and its tolist) timed right
    after a q=1 forward of `model` and again right after itself (medians). On a CPU a forward streams the
    model's weights through the caches the step's Python and data then have to be read back into."""
    prefix = prefill(model, min(prefix, model.max_length // 2))
    ids, positions = torch.zeros(1, dtype=torch.long, device=model.device), torch.tensor([prefix], device=model.device)
    rng = np.random.default_rng(0)
    table, rows, columns = rng.standard_normal((32, 4096), np.float32), rng.integers(0, 32, 64), rng.integers(0, 4096, 64)

    def work() -> float:
        start = time.perf_counter()
        sum(i * 3 % 7 for i in range(200))
        table[rows, columns].tolist()
        return time.perf_counter() - start

    after, again = [], []
    for _ in range(repeats + 1):
        model.forward(ids, positions, None)
        model.runtime.synchronize()
        after.append(work())
        again.append(work())
        model.commit([])
    model.reset()
    return {"after a forward": 1e6 * float(np.median(after[1:])), "again": 1e6 * float(np.median(again[1:]))}


def by_count(table: dict) -> dict[int, float]:
    """A table of ms by node count as JSON keeps it (keys as strings), keyed by int again."""
    return {int(q): ms for q, ms in table.items()}
