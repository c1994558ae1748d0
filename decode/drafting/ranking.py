"""How drafters rank and draw continuations from the draft's logits, and keep the best nodes of a tree."""
import math

import numpy as np
import torch

from decode import native
from decode.models.cached_lm import Shortlist
from decode.sampling import (Sampling, Sparse, Uniforms, inverse_cdf, ranked_tokens, tokens_at, top_tokens, values_at,
                             values_list)
from decode.tree import Tree

ARRAY_NODES = 128  # trees (and candidate lists) past this size are ranked by array code, smaller ones in Python lists

def ranking_scores(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """What the drafters rank continuations by, a row per scored node: the processed distribution when
    sampling, the logits themselves when greedy (a point mass would rank only one child). A greedy child's
    weight is then `relative`: its probability over its likeliest sibling's, which needs no pass of exp over
    the vocabulary (a softmax over 20-40 rows of 8192 logits was the largest piece of a staged step's time
    around the forwards on a CPU). The ranking decides only what is proposed, never what is accepted."""
    return logits if sampling.greedy else sampling.probs(logits)


def relative(values: list[float], best: float) -> list[float]:
    """Greedy ranking weights from logits (`ranking_scores`): exp(logit - the row's best logit)."""
    return [math.exp(v - best) for v in values]


def ranked_children(scores: torch.Tensor, tree: Tree, k: int, greedy: bool, order: list[int] | None = None,
                    shortlist: Shortlist | None = None) -> tuple[list[float], list[list[int]], list[list[float]]]:
    """From the draft's ranking scores after every node of `tree` (`ranking_scores`, a row per node, row i
    after node `order[i]`, by default node i; its columns the `shortlist`'s tokens when there is one): each
    node's weight given its parent (the root's: 1; 0 for a token off the shortlist), and each node's `k` best
    children and their weights. One argmax (or top-k) and one gather: right after the draft's forward, each
    torch or numpy call costs microseconds on a CPU, a step of Python over a node a fraction of one. Past
    ARRAY_NODES nodes, `ranked_children_arrays` computes the same faster."""
    n = len(tree)
    best = ranked_tokens(scores, k, shortlist)
    row = list(range(n))  # node -> its row
    if order is not None:
        for i, node in enumerate(order):
            row[node] = i
        best = [best[row[node]] for node in range(n)]
    read_rows = [row[parent] for parent in tree.parents[1:]] + [row[node] for node in range(n) for _ in range(k)]
    read_columns = tree.tokens[1:] + [token for tokens in best for token in tokens]  # each edge, then each best child
    values = values_list(scores, read_rows, read_columns, shortlist)  # one read: off the CPU, one transfer
    edges, rows = values[: n - 1], [values[n - 1 + i * k : n - 1 + (i + 1) * k] for i in range(n)]
    if greedy:  # each row's best value comes first
        edges = [math.exp(v - rows[parent][0]) for parent, v in zip(tree.parents[1:], edges)]
        rows = [[1.0] for _ in rows] if k == 1 else [relative(row, row[0]) for row in rows]
    return [1.0] + edges, best, rows


def ranked_children_arrays(scores: torch.Tensor, tree: Tree, k: int, greedy: bool, order: list[int] | None = None,
                           shortlist: Shortlist | None = None) -> tuple[list[float], np.ndarray, np.ndarray]:
    """`ranked_children` as array code (what runs per node in Python there runs per tree here), the best
    children and their weights as (n, k) arrays."""
    n = len(tree)
    row = np.arange(n)  # node -> its row
    if order is not None:
        row[order] = row.copy()
    best = top_tokens(scores, k, shortlist)[row]
    parents, tokens = np.array(tree.parents[1:], np.int64), np.array(tree.tokens[1:], np.int64)
    values = values_at(scores, np.concatenate([row[parents], np.repeat(row, k)]),
                       np.concatenate([tokens, best.ravel()]), shortlist).astype(np.float64)
    edges, rows = values[: n - 1], values[n - 1 :].reshape(n, k)
    if greedy:  # each row's best value comes first
        edges, rows = np.exp(edges - rows[parents, 0]), np.exp(rows - rows[:, :1])
    return [1.0, *edges.tolist()], best, rows


def draw_children(sampling: Sampling, logits: torch.Tensor, count: int, generator: Uniforms,
                  shortlist: Shortlist | None = None,
                  rows: list[int] | None = None) -> tuple[list[list[int]], list[Sparse] | torch.Tensor]:
    """`count` independent draws from the draft's q after each of `rows` of the logits (default: every row), and each
    one's q, the distribution multi-draft rejection checks the draws against: under top-k sampling the draft's
    processed distribution (Sampling.distributions), else its proposal (Sampling.proposal) over the whole vocabulary,
    a row of a tensor, drawn from by inverting its cumulative sums (`inverse_cdf`). With a `shortlist`, the logits'
    columns are its tokens."""
    if sampling.sparse:
        rows = list(range(logits.shape[0])) if rows is None else rows
        if native.takes(logits):
            return native.draws(logits, rows, count, sampling, shortlist, generator.take(len(rows) * count), Sparse)
        qs = sampling.distributions(logits, rows, shortlist)
        uniforms = generator.take(len(qs) * count)
        return [[q.draw(u) for u in uniforms[i * count : (i + 1) * count]] for i, q in enumerate(qs)], qs
    probs, columns = sampling.proposal(logits if rows is None else logits[rows])
    tokens = tokens_at(columns, shortlist)
    points = torch.tensor(generator.take(len(probs) * count), dtype=torch.float64, device=probs.device)
    drawn = tokens.gather(-1, inverse_cdf(probs, points.view(len(probs), count)))
    vocab_size = logits.shape[-1] if shortlist is None else shortlist.vocab_size
    return drawn.tolist(), probs.new_zeros((*probs.shape[:-1], vocab_size)).scatter_(-1, tokens, probs)


def draw_below(sampling: Sampling, sources: list[tuple[torch.Tensor, int]], count: int, generator: Uniforms,
               shortlist: Shortlist | None = None) -> tuple[list[list[int]], list]:
    """`draw_children` after rows of several draft calls' logits, `sources[i]` = (logits, row), a repeated source drawn
    from afresh: one `draw_children` per logits tensor, so a level of a tree costs one read of its distributions, a
    transfer on a GPU (there, reads node by node were most of a sampled step's time)."""
    groups = {}  # id(logits) -> (logits, [(i, row)])
    for i, (logits, row) in enumerate(sources):
        groups.setdefault(id(logits), (logits, []))[1].append((i, row))
    drawn, qs = [None] * len(sources), [None] * len(sources)
    for logits, members in groups.values():
        tokens, q = draw_children(sampling, logits, count, generator, shortlist, [row for _, row in members])
        for (i, _), row_tokens, row_q in zip(members, tokens, q):
            drawn[i], qs[i] = row_tokens, row_q
    return drawn, qs


def best_first(scores: list[float], budget: int) -> list[int]:
    """The `budget` nodes of highest score (a path probability), in topological order; ancestor-closed
    because a child never beats its parent (ties go to the earlier node, and parents come first).
    Past ARRAY_NODES scores, only those at or above the budget-th are sorted, in numpy."""
    if len(scores) <= ARRAY_NODES:
        return sorted(sorted(range(len(scores)), key=scores.__getitem__, reverse=True)[:budget])
    values, budget = np.array(scores), min(budget, len(scores))
    pool = np.flatnonzero(values >= np.partition(values, -budget)[-budget])
    return np.sort(pool[np.argsort(-values[pool], kind="stable")[:budget]]).tolist()
