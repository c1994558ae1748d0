"""What a plan is made from: how often each drafter's rank-k candidate at depth d is the oracle's token, and
Sequoia's best static tree under those rates (Chen et al. 2024).

    acceptance   how often the oracle's token is the drafter's rank-k candidate at depth d (teacher forced)
    best_shapes  Sequoia's dynamic programme: the static tree of n nodes and depth D with the most
                 expected accepted tokens under those rates
"""
import math

import numpy as np
import torch

from decode.models.cached_lm import CachedLM
from decode.tensors import long_tensor
from decode.tree import Shape


def ranks(model: CachedLM, prompt: list[int], continuation: list[int]) -> list[int]:
    """The rank of each continuation token among the model's next-token logits (0: its argmax),
    the model reading the prompt and the continuation before it (teacher forcing)."""
    model.reset()
    logits = model.extend_whole(long_tensor(prompt + continuation[:-1], model.device))[len(prompt) - 1 :]
    target = logits.gather(1, long_tensor(continuation, model.device)[:, None])
    return (logits > target).sum(1).tolist()


def trigram_ranks(table, prompt: list[int], continuation: list[int]) -> list[int]:
    """The rank of each continuation token among the trigram's top successors (table.k: not among them)."""
    sequence = [table.bos] + prompt + continuation
    ends = np.arange(len(prompt) + 1, len(sequence))  # each continuation token's index in `sequence`
    u, v, token = np.array(sequence)[ends - 2], np.array(sequence)[ends - 1], np.array(sequence)[ends]
    successors, _ = table.lookup(u, v)
    hit = successors == token[:, None]
    return np.where(hit.any(1), hit.argmax(1), table.k).tolist()


def acceptance(rank_lists: list[list[int]], width: int, depth: int) -> list[list[float]]:
    """p[d][k]: how often the oracle's token at depth d + 1 of a tree is the drafter's rank-k
    candidate, among the places a tree of `width` children per node can reach (every token above
    it at a rank below `width`)."""
    hits = np.zeros((depth, width))
    reached = np.zeros(depth)
    for r in rank_lists:
        for start in range(len(r)):
            for d in range(min(depth, len(r) - start)):
                reached[d] += 1
                if r[start + d] >= width:
                    break
                hits[d, r[start + d]] += 1
    return (hits / np.maximum(reached, 1)[:, None]).tolist()


def overlaps(oracle: CachedLM, draft: CachedLM, sampling, prompt: list[int], continuation: list[int]) -> list[float]:
    """sum_x min(p(x), q(x)) of the processed distributions at each continuation position (teacher
    forced): the chance that the oracle accepts a token the draft samples there (Chen et al.)."""
    ids = long_tensor(prompt + continuation[:-1], oracle.device)
    dists = []
    for model in (oracle, draft):
        model.reset()
        dists.append(sampling.probs(model.extend_whole(ids)[len(prompt) - 1 :]))
    return torch.minimum(*dists).sum(-1).tolist()


def chain_acceptance(overlap_lists: list[list[float]], depth: int) -> list[float]:
    """For d = 1 .. depth, the chance that a sampled chain's first d tokens are all accepted: the mean
    over starting positions of the product of the next d overlaps."""
    totals, counts = np.zeros(depth), np.zeros(depth)
    for a in overlap_lists:
        for start in range(len(a)):
            prefix = np.cumprod(a[start : start + depth])
            totals[: len(prefix)] += prefix
            counts[: len(prefix)] += 1
    return (totals / np.maximum(counts, 1)).tolist()


def best_shapes(p: list[list[float]], max_nodes: int, depth: int) -> list[Shape | None]:
    """For n = 1 .. max_nodes (root included), the tree of at most `depth` levels with the most
    expected accepted nodes, when the oracle's token at depth d + 1 is the rank-k candidate with
    probability p[d][k], independently of the rest (Sequoia's positional acceptance). Entry n
    (None at 0, and where no such tree exists). The value of m nodes below an accepted node at depth d is a knapsack over its
    children's ranks: rank k, given s nodes, adds p[d][k] * (1 + value of s - 1 nodes below it)."""
    width, m_max = len(p[0]), max_nodes - 1
    below = [[0.0] + [-math.inf] * m_max for _ in range(depth + 1)]  # nothing fits below the deepest level
    split = {}  # (d, k) -> for m nodes among ranks k.., the nodes that rank k's subtree gets
    for d in reversed(range(depth)):
        rest = [0.0] + [-math.inf] * m_max  # ranks past the last: no nodes
        for k in reversed(range(width)):
            best, choice = rest[:], [0] * (m_max + 1)
            for m in range(1, m_max + 1):
                for s in range(1, m + 1):
                    sub, others = below[d + 1][s - 1], rest[m - s]
                    if sub > -math.inf and others > -math.inf:
                        value = p[d][k] * (1 + sub) + others
                        if value > best[m]:
                            best[m], choice[m] = value, s
            split[d, k], rest = choice, best
        below[d] = rest
    shapes: list[Shape | None] = [None]
    for n in range(1, max_nodes + 1):
        if below[0][n - 1] == -math.inf:  # more nodes than `depth` levels of `width` children hold
            shapes.append(None)
            continue
        parents, node_ranks, depths, queue = [-1], [0], [0], [(0, n - 1)]
        for node, m in queue:  # level by level: the queue grows as children are placed
            for k in range(width):
                s = split[depths[node], k][m] if m and depths[node] < depth else 0
                if s:
                    parents.append(node)
                    node_ranks.append(k)
                    depths.append(depths[node] + 1)
                    queue.append((len(parents) - 1, s - 1))
                    m -= s
        shapes.append(Shape(parents, node_ranks, below[0][n - 1]))
    return shapes
