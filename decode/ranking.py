"""How drafters rank and draw continuations from the draft's logits, and keep the best nodes of a tree."""
import math

import numpy as np
import torch

from decode.sampling import Sampling, Sparse, Uniforms, inverse_cdf, tokens_at, top_tokens, values_at
from decode.shortlist import Shortlist
from decode.tree import Tree


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
                    shortlist: Shortlist | None = None) -> tuple[list[float], np.ndarray, np.ndarray]:
    """From the draft's ranking scores after every node of `tree` (`ranking_scores`, a row per node, row i
    after node `order[i]`, by default node i; its columns the `shortlist`'s tokens when there is one): each
    node's weight given its parent (the root's: 1; 0 for a token off the shortlist), and each node's `k` best
    children and their weights, as (n, k) arrays. One top-k and one gather for the whole tree."""
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


def draft_leaves(tree: Tree, tokens: np.ndarray, weights: np.ndarray,
                 max_depth: int) -> tuple[list[int], list[int], list[float]]:
    """The draft's best children (`ranked_children`) of every node above `max_depth` that `tree` does not hold
    already: (parents, tokens, weights)."""
    above = np.flatnonzero(np.array(tree.depths) < max_depth)
    parents, tokens, weights = np.repeat(above, tokens.shape[1]), tokens[above].ravel(), weights[above].ravel()
    vocab = 1 + max(int(tokens.max(initial=0)), max(tree.tokens))
    keys = parents * vocab + tokens  # (parent, token) as one number; the tree's own children likewise:
    proposed = np.sort(np.array(tree.parents, np.int64) * vocab + np.array(tree.tokens, np.int64))
    fresh = proposed[np.searchsorted(proposed, keys, side="right") - 1] != keys  # the root's key is below all
    return parents[fresh].tolist(), tokens[fresh].tolist(), weights[fresh].tolist()


def staged_selection(tree: Tree, logits: torch.Tensor, order: list[int], copied: set[int], max_depth: int,
                     budget: int, children: int, sampling: Sampling,
                     shortlist: Shortlist | None = None) -> tuple[Tree, list[int]]:
    """The staged drafter's tree for the oracle, from the trigram's (and the context's) tree and the draft's logits
    after its nodes (row i after node order[i]): the `budget` candidates of highest cumulative draft weight among the
    tree's nodes and the draft's own `children` best children of each node above `max_depth`, the `copied` nodes
    first; and for each node, the candidate it came from (n + i: the draft's leaf i)."""
    edges, best, best_weights = ranked_children(ranking_scores(logits, sampling), tree, children, sampling.greedy,
                                                order, shortlist)
    cumulative = tree.cumulative(edges)
    leaf_parents, leaf_tokens, leaf_weights = draft_leaves(tree, best, best_weights, max_depth)
    candidates = cumulative + [cumulative[parent] * w for parent, w in zip(leaf_parents, leaf_weights)]
    if copied:  # the context's continuations go first, with the root above them
        for node in copied | {0}:
            candidates[node] += 1.0
    chosen = best_first(candidates, budget)  # candidate n + i is the draft's leaf i
    return Tree.chosen(tree.tokens + leaf_tokens, tree.parents + leaf_parents, chosen, candidates)


def draw_children(kernels, sampling: Sampling, logits: torch.Tensor, count: int, generator: Uniforms,
                  shortlist: Shortlist | None = None,
                  rows: list[int] | None = None) -> tuple[list[list[int]], list[Sparse] | torch.Tensor]:
    """`count` independent draws from the draft's q after each of `rows` of the logits (default: every row), and each
    one's q, the distribution multi-draft rejection checks the draws against: under top-k sampling the draft's
    processed distribution (Sampling.distributions), else its proposal (Sampling.proposal) over the whole vocabulary,
    a row of a tensor, drawn from by inverting its cumulative sums (`inverse_cdf`). With a `shortlist`, the logits'
    columns are its tokens. Under a top-k setting the `kernels` (decode.kernels) draw."""
    if sampling.sparse:
        rows = list(range(logits.shape[0])) if rows is None else rows
        return kernels.draws(logits, rows, count, sampling, shortlist, generator.take(len(rows) * count))
    probs, columns = sampling.proposal(logits if rows is None else logits[rows])
    tokens = tokens_at(columns, shortlist)
    points = torch.tensor(generator.take(len(probs) * count), dtype=torch.float64, device=probs.device)
    drawn = tokens.gather(-1, inverse_cdf(probs, points.view(len(probs), count)))
    vocab_size = logits.shape[-1] if shortlist is None else shortlist.vocab_size
    return drawn.tolist(), probs.new_zeros((*probs.shape[:-1], vocab_size)).scatter_(-1, tokens, probs)


def draw_below(kernels, sampling: Sampling, sources: list[tuple[torch.Tensor, int]], count: int, generator: Uniforms,
               shortlist: Shortlist | None = None) -> tuple[list[list[int]], list]:
    """`draw_children` after rows of several draft calls' logits, `sources[i]` = (logits, row), a repeated source drawn
    from afresh: one `draw_children` per logits tensor, so a level of a tree costs one read of its distributions, a
    transfer on a GPU (there, reads node by node were most of a sampled step's time)."""
    groups: dict[int, tuple[torch.Tensor, list[tuple[int, int]]]] = {}  # id(logits) -> (logits, [(i, row)])
    for i, (logits, row) in enumerate(sources):
        groups.setdefault(id(logits), (logits, []))[1].append((i, row))
    drawn: list = [None] * len(sources)
    qs: list = [None] * len(sources)
    for logits, members in groups.values():
        tokens, q = draw_children(kernels, sampling, logits, count, generator, shortlist, [row for _, row in members])
        for (i, _), row_tokens, row_q in zip(members, tokens, q):
            drawn[i], qs[i] = row_tokens, row_q
    return drawn, qs


def best_first(scores: list[float], budget: int) -> list[int]:
    """The `budget` nodes of highest score (a path probability), in topological order; ancestor-closed
    because a child never beats its parent (ties go to the earlier node, and parents come first). Only the
    scores at or above the budget-th are sorted."""
    values, budget = np.array(scores), min(budget, len(scores))
    pool = np.flatnonzero(values >= np.partition(values, -budget)[-budget])
    return np.sort(pool[np.argsort(-values[pool], kind="stable")[:budget]]).tolist()
