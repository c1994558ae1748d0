"""Drafters: each proposes a Tree rooted at the last accepted token for the oracle to verify.

    chain   the draft model proposes k tokens one after another (standard speculative decoding)
    tree    the draft model expands the nodes of highest cumulative probability, a few children each
    shaped  the draft model fills a fixed tree of ranks, a level per call (Sequoia; decode.plan's tree)
    staged  the Katz trigram proposes children level by level, the draft model scores all of them in
            one forward pass, and the best `budget` nodes by cumulative draft probability are kept
    ngram   the trigram alone, ranked by cumulative trigram probability
    lookup  the continuations of the current suffix's earlier occurrences in the context, no model

A drafter that uses the draft model keeps its KV cache on the accepted prefix. Each step begins
with the accepted tokens the draft has not seen (the oracle's last token, the root, among them);
the step's first forward feeds them together with the first tree nodes, so a staged step costs one
draft call. `accept` commits them and the accepted nodes the draft scored.
"""

import math
from typing import Callable, NamedTuple

import numpy as np
import torch

from decode import native
from decode.cached_lm import CachedLM, Shortlist
from decode.lookup import ContextIndex
from decode.sampling import Sampling, ranked_tokens, row_argmax, tokens_at, top_tokens, values_at, values_list
from decode.tree import Tree, rows_mask


ARRAY_NODES = 128  # trees (and candidate lists) past this size are ranked by array code, smaller ones in Python lists


def remember(memo: dict, key, make: Callable, size: int):
    """memo[key], made once by `make()`; a memo that holds `size` entries is emptied first."""
    if key not in memo:
        if len(memo) >= size:
            memo.clear()
        memo[key] = make()
    return memo[key]


class Call(NamedTuple):
    """One draft forward's bookkeeping (DraftModel.plan): the tree nodes it feeds after the unseen tokens, each one's
    pending slot and the slots it sees (as bits), the attention mask (None: causal), each fed token's position past
    the cache, and how many rows of logits it returns (None: all)."""
    new: list[int]
    slots: dict[int, int]
    sees: dict[int, int]
    mask: torch.Tensor | None
    offsets: list[int]
    last: int | None


class DraftModel:
    """The draft model's cache bookkeeping for one step: which pending slot holds which tree node."""

    def __init__(self, model: CachedLM):
        self.model = model
        self.shortlist = model.shortlist  # the tokens of the draft's logits' columns (None: every token)
        self.calls = 0
        self.slots = {}
        self.known = {}  # (a call's `repeats` key, unseen tokens, pending slots) -> its Call

    def reset(self) -> None:
        self.model.reset()
        self.calls = 0

    def start(self, tokens: list[int]) -> None:
        """A new step: the accepted tokens past the draft's cache, the root last, are fed with the first score."""
        self.unseen = tokens[self.model.length :]
        self.slots = {}  # tree node -> pending slot
        self.sees = {}  # tree node -> the pending slots it attends to, as bits

    def score(self, tree: Tree, nodes: list[int], repeats=None) -> torch.Tensor:
        """Logits after each of `nodes`, in one forward pass. Their ancestors must be scored already or
        among them; the step's first call scores the root (node 0, first in `nodes`) with the unseen accepted tokens.
        A drafter whose steps repeat the same calls on trees of one shape names each call's place (`repeats`, any
        hashable key): its slots, mask and positions are then worked out once per number of unseen tokens (3-4 us a
        call saved on a CPU, where this runs cold after the draft's previous forward)."""
        model, pending = self.model, self.model.pending
        run = self.unseen if not self.slots else []
        if run and nodes[0] != 0:
            raise ValueError("a step's first draft call scores the root first")
        if repeats is None:
            call = self.plan(tree, nodes, len(run), pending)
        else:
            call = remember(self.known, (repeats, len(run), pending), lambda: self.plan(tree, nodes, len(run), pending),
                            1 << 12)
        self.slots.update(call.slots)
        self.sees.update(call.sees)
        self.calls += 1
        ids = run + [tree.tokens[n] for n in call.new]
        positions = [model.length + offset for offset in call.offsets]
        return model.forward(ids, positions, call.mask, call.last)  # row i: after nodes[i]

    def plan(self, tree: Tree, nodes: list[int], unseen: int, pending: int) -> Call:
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
    torch or numpy call costs microseconds on a CPU, a step of Python over a node a fraction of one. Trees of
    more than ARRAY_NODES nodes take `ranked_children_arrays`."""
    n = len(tree)
    if n > ARRAY_NODES:
        return ranked_children_arrays(scores, tree, k, greedy, order, shortlist)
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


def draw_children(sampling: Sampling, logits: torch.Tensor, count: int, generator,
                  shortlist: Shortlist | None = None) -> tuple[list[list[int]], torch.Tensor]:
    """`count` independent draws per row from the draft's proposal (Sampling.proposal; over the `shortlist`'s
    tokens when the logits are theirs), and each row's proposal over the whole vocabulary, the q that
    multi-draft rejection checks the draws against."""
    probs, columns = sampling.proposal(logits)
    tokens = tokens_at(columns, shortlist)
    drawn = tokens.gather(-1, torch.multinomial(probs, count, replacement=True, generator=generator))
    vocab_size = logits.shape[-1] if shortlist is None else shortlist.vocab_size
    return drawn.tolist(), probs.new_zeros((*logits.shape[:-1], vocab_size)).scatter_(-1, tokens, probs)


def best_first(scores: list[float], budget: int) -> list[int]:
    """The `budget` nodes of highest score (a path probability), in topological order; ancestor-closed
    because a child never beats its parent (ties go to the earlier node, and parents come first).
    Past ARRAY_NODES scores, only those at or above the budget-th are sorted, in numpy."""
    if len(scores) <= ARRAY_NODES:
        return sorted(sorted(range(len(scores)), key=scores.__getitem__, reverse=True)[:budget])
    values, budget = np.array(scores), min(budget, len(scores))
    pool = np.flatnonzero(values >= np.partition(values, -budget)[-budget])
    return np.sort(pool[np.argsort(-values[pool], kind="stable")[:budget]]).tolist()


class ModelDrafter:
    """A drafter that uses the draft model. `propose` builds the tree; when it prunes a larger tree,
    `kept` maps each proposed node to the node the draft model scored (None: a node it did not score)."""

    def __init__(self, model: CachedLM, sampling: Sampling, sampled: bool = False):
        self.draft, self.sampling, self.sampled = DraftModel(model), sampling, sampled
        self.kept = None

    @property
    def sampled_children(self) -> bool:
        """Children drawn from the draft, verified by multi-draft rejection, rather than its top tokens,
        verified by sample-match. Only when sampling: a greedy draft's point mass has nothing to draw."""
        return self.sampled and not self.sampling.greedy

    def reset(self) -> None:
        self.draft.reset()

    @property
    def calls(self) -> int:
        return self.draft.calls

    def accept(self, path: list[int]) -> None:
        self.draft.accept([self.kept[n] for n in path] if self.kept is not None else path)


class ChainDrafter(ModelDrafter):
    """k tokens from the draft model one after another: its argmax when greedy (verified by
    sample-match), else samples from q (verified by rejection sampling)."""

    def __init__(self, model: CachedLM, sampling: Sampling, k: int):
        super().__init__(model, sampling, sampled=True)
        self.k = k

    def propose(self, tokens: list[int], max_depth: int, generator) -> Tree:
        tree = Tree.rooted(tokens[-1])
        self.draft.start(tokens)
        node = 0
        for _ in range(min(self.k, max_depth)):
            logits = self.draft.score(tree, [node], repeats=node)  # every step's tree is a chain
            if self.sampled_children:
                (token,), q = draw_children(self.sampling, logits[0], 1, generator, self.draft.shortlist)
                tree.child_dists[node] = q
            else:
                token = row_argmax(logits, self.draft.shortlist)[0]
            node = tree.add(node, token)
        return tree


class TreeDrafter(ModelDrafter):
    """The draft model grows a tree best-first: each forward pass expands the unexpanded nodes of
    highest cumulative probability (up to `expand` of them), `branch` children each, until the tree
    holds `budget` nodes or reaches `depth`. Children are the draft's top tokens (then the final tree
    is the best `budget` nodes, verified by sample-match) or, with `sampled=True`, independent
    samples from the draft (kept as drawn, verified by multi-draft rejection)."""

    def __init__(self, model: CachedLM, sampling: Sampling, budget: int = 36, depth: int = 8, branch: int = 4,
                 expand: int = 4, sampled: bool = False):
        super().__init__(model, sampling, sampled)
        self.budget, self.depth, self.branch, self.expand = budget, depth, branch, expand

    def _children(self, tree: Tree, cumulative: list[float], nodes: list[int], logits: torch.Tensor, generator) -> None:
        if self.sampled_children:
            drawn, q = draw_children(self.sampling, logits, self.branch, generator, self.draft.shortlist)
            for node, tokens, row in zip(nodes, drawn, q):
                tree.child_dists[node] = row
                for token in tokens:
                    tree.add(node, token)
                    cumulative.append(cumulative[node] * float(row[token]))
            return
        top = ranking_scores(logits, self.sampling).topk(self.branch)
        for node, values, tokens in zip(nodes, top.values.tolist(), tokens_at(top.indices, self.draft.shortlist).tolist()):
            for p, token in zip(relative(values, values[0]) if self.sampling.greedy else values, tokens):
                tree.add(node, token)
                cumulative.append(cumulative[node] * p)

    def propose(self, tokens: list[int], max_depth: int, generator) -> Tree:
        tree, cumulative = Tree.rooted(tokens[-1]), [1.0]
        self.kept = None
        self.draft.start(tokens)
        depth = min(self.depth, max_depth)
        if depth == 0:
            return tree
        self._children(tree, cumulative, [0], self.draft.score(tree, [0]), generator)
        expanded = {0}
        while len(tree) + self.branch <= (self.budget if self.sampled_children else 2 * self.budget):
            candidates = sorted((n for n in range(len(tree)) if n not in expanded and tree.depths[n] < depth),
                                key=lambda n: -cumulative[n])
            room = (self.budget - len(tree)) // self.branch if self.sampled_children else self.expand
            nodes = sorted(candidates[: min(self.expand, room)])
            if not nodes:
                break
            self._children(tree, cumulative, nodes, self.draft.score(tree, nodes), generator)
            expanded.update(nodes)
        if self.sampled_children:  # sampled children stay as drawn: pruning by value would bias them
            return tree
        tree, self.kept = tree.subtree(best_first(cumulative, self.budget), cumulative)
        return tree


class ShapedTreeDrafter(ModelDrafter):
    """Sequoia's tree: a fixed shape filled with the draft's ranked tokens, one draft call per level.
    Node i of the shape hangs below `parents[i]` as its parent's rank-`ranks[i]` token (0: the
    draft's best); shape nodes come level by level. decode.plan chooses the shape (planning.best_shape).
    With `sampled` children (when sampling), a node's children in the shape are instead that many
    independent draws from the draft's q, verified by multi-draft rejection."""

    def __init__(self, model: CachedLM, sampling: Sampling, parents: list[int], ranks: list[int],
                 sampled: bool = False):
        super().__init__(model, sampling, sampled)
        self.parents, self.ranks = list(parents), list(ranks)
        self.below = [[] for _ in self.parents]  # shape node -> its children in the shape
        for node, parent in enumerate(self.parents[1:], 1):
            self.below[parent].append(node)
        # shape node -> how many of the draft's ranked tokens its children read
        self.widest = [1 + max((self.ranks[c] for c in children), default=-1) for children in self.below]
        self.layouts = {}

    def layout(self, max_depth: int) -> tuple[Tree, list[tuple[list[int], int, int, list[tuple[int, int, int, int]]]]]:
        """The tree a step grows at most `max_depth` levels deep (its tokens to be filled in) and, per level, the
        nodes the draft scores, the most ranked tokens and the most draws a row's children take, and each child as
        (node, its parent's row, its place among its siblings, its rank). Every step grows the same tree, so it is
        laid out once: growing it node by node took 5-6 us a level right after a draft forward on a CPU."""
        depth = min(max_depth, len(self.parents))
        if depth not in self.layouts:
            tree, level, levels = Tree.rooted(0), [(0, 0)], []  # level: (tree node, the shape node it fills)
            for _ in range(depth):
                level = [(node, shaped) for node, shaped in level if self.below[shaped]]
                if not level:
                    break
                children = [(tree.add(node, 0), row, place, child) for row, (node, shaped) in enumerate(level)
                            for place, child in enumerate(self.below[shaped])]
                levels.append(([node for node, _ in level], max(self.widest[s] for _, s in level),
                               max(len(self.below[s]) for _, s in level),
                               [(node, row, place, self.ranks[child]) for node, row, place, child in children]))
                level = [(node, child) for node, _, _, child in children]
            self.layouts[depth] = tree, levels
        return self.layouts[depth]

    def propose(self, tokens: list[int], max_depth: int, generator) -> Tree:
        shape, levels = self.layout(max_depth)
        tree = shape.copy([tokens[-1]] + shape.tokens[1:])
        self.draft.start(tokens)
        for level, (nodes, widest, draws, children) in enumerate(levels):
            logits = self.draft.score(tree, nodes, repeats=(len(levels), level))
            if self.sampled_children:  # child j of a node is its j-th independent draw
                drawn, q = draw_children(self.sampling, logits, draws, generator, self.draft.shortlist)
                tree.child_dists.update(zip(nodes, q))
                for node, row, place, _ in children:
                    tree.tokens[node] = drawn[row][place]
            else:  # child j is the draft's rank-ranks[j] token
                ranked = ranked_tokens(ranking_scores(logits, self.sampling), widest, self.draft.shortlist)
                for node, row, _, rank in children:
                    tree.tokens[node] = ranked[row][rank]
        return tree


class TrigramTrees:
    """The trigram's tree below a context, `widths[d]` children per node at depth d. Every such tree has
    the same shape (the table keeps at least max(widths) successors of every context), so a context's tree
    is its tokens and probabilities, a gather a level, laid on the shape. A tree depends only on
    the last two tokens, so each is built once and remembered, up to `size` of them: code repeats its
    contexts. Callers get a copy to grow; `best`, the trigram's own selection, is remembered too."""

    def __init__(self, table, widths, size: int = 1 << 14):
        self.table, self.widths, self.size, self.shapes = table, list(widths), size, {}
        self.built, self.selected = {}, {}
        self.native = native.trigram_source(table)  # None: `build` in Python

    def forget(self) -> None:
        """Drop every remembered tree: drafting then costs what it does in a new decoder."""
        self.built.clear()
        self.selected.clear()

    def __call__(self, tokens: list[int], max_depth: int) -> tuple[Tree, list[float]]:
        """The tree below tokens[-1] (at most `max_depth` levels) and each node's trigram probability
        given its parent (the root's: 1)."""
        key = self.key(tokens, max_depth)
        node_tokens, probs = self.remembered(key)
        return self.shape(key[2]).copy(node_tokens), probs

    def best(self, tokens: list[int], max_depth: int, budget: int) -> Tree:
        """The `budget` nodes of that tree of highest cumulative trigram probability (`best_first`),
        likeliest path first (`Tree.subtree`); remembered, and shared: callers must not grow it."""
        key = self.key(tokens, max_depth)
        return remember(self.selected, key + (budget,), lambda: self.select(key, budget), self.size)

    def select(self, key: tuple[int, int, int], budget: int) -> Tree:
        node_tokens, probs = self.remembered(key)
        cumulative = self.cumulative(probs, key[2])
        return Tree.chosen(node_tokens, self.shape(key[2]).parents, best_first(cumulative, budget), cumulative)[0]

    def cumulative(self, probs: list[float], depth: int):
        """`Tree.cumulative` on the shape `depth` levels deep; past ARRAY_NODES nodes a level at a time in
        numpy (the same products in the same order)."""
        shape = self.shape(depth)
        if len(shape) <= ARRAY_NODES:
            return shape.cumulative(probs)
        values, above = np.array(probs), slice(0, 1)
        for width in self.widths[:depth]:
            level = slice(above.stop, above.stop + (above.stop - above.start) * width)
            values[level] *= np.repeat(values[above], width)
            above = level
        return values

    def key(self, tokens: list[int], max_depth: int) -> tuple[int, int, int]:
        return tokens[-2] if len(tokens) > 1 else self.table.bos, tokens[-1], min(max_depth, len(self.widths))

    def remembered(self, key: tuple[int, int, int]) -> tuple[list[int], list[float]]:
        """The tokens and probabilities of the tree below a key's context (`build`)."""
        return remember(self.built, key, lambda: self.build(*key), self.size)

    def shape(self, depth: int) -> Tree:
        """The shape of every tree `depth` levels deep: nodes level by level, each parent's children by rank."""
        if depth not in self.shapes:
            tree, level = Tree.rooted(0), [0]
            for width in self.widths[:depth]:
                level = tree.add_level([n for n in level for _ in range(width)], [0] * (len(level) * width))
            self.shapes[depth] = tree
        return self.shapes[depth]

    def build(self, before_root: int, root: int, depth: int) -> tuple[list[int], list[float]]:
        """The tokens and probabilities of the tree's nodes, in the shape's order: one search for the root's
        row of the successor table, then a gather a level (each successor names the row after it);
        decode/native_step.cpp reads the same rows where it can."""
        if self.native is not None:
            return native.trigram_tree(self.native, before_root, root, self.widths[:depth])
        tokens, probs = [root], [1.0]
        rows = self.table.rows_after(np.array([before_root]), np.array([root]))
        for width in self.widths[:depth]:
            level = self.table.successors[rows, :width].ravel()
            tokens += level["token"].tolist()
            probs += level["prob"].tolist()
            rows = level["next"]
        return tokens, probs


class StagedDrafter(ModelDrafter):
    """Staged speculative decoding: the trigram drafts for the draft model, which drafts for the oracle.
    One draft forward per step scores the unseen accepted tokens and the trigram's whole tree; the
    draft's own top children of every scored node join as candidate leaves. With a `context` drafter,
    the continuations it copies from the context join the tree and are always kept: a copy of what
    the sequence already did is accepted far more often than the draft's probabilities suggest.
    With `sampled` children (when sampling), the oracle's tree is drawn from the draft instead
    (`sampled_tree`): the trigram's tree only decides where the draft's q is known."""

    def __init__(self, model: CachedLM, table, sampling: Sampling, budget: int = 36, widths=(12, 7, 4, 1, 1, 1),
                 draft_children: int | None = None, context: "LookupDrafter | None" = None, depth: int = 8,
                 sampled: bool = False):
        """`context` grafts its continuations from the context onto the trigram's tree (down to `depth`).
        `draft_children`: the draft's best children per node (None: 1), or its draws per node when the
        children are sampled (None: 2; measured best on the cpu preset at top-k 50)."""
        super().__init__(model, sampling, sampled)
        self.trigram, self.budget, self.draft_children = TrigramTrees(table, widths), budget, draft_children
        self.context, self.depth = context, depth

    def reset(self) -> None:
        super().reset()
        if self.context is not None:
            self.context.reset()

    @staticmethod
    def draft_leaves(tree: Tree, tokens: list[list[int]], weights: list[list[float]],
                     max_depth: int) -> tuple[list[int], list[int], list[float]]:
        """The draft's best children (`ranked_children`) of every node above `max_depth` that the trigram
        did not propose: (parents, tokens, weights). Past ARRAY_NODES nodes, in numpy."""
        if len(tree) > ARRAY_NODES:
            return StagedDrafter.draft_leaves_arrays(tree, np.asarray(tokens), np.asarray(weights), max_depth)
        proposed = set(zip(tree.parents, tree.tokens))
        parents, leaf_tokens, leaf_weights = [], [], []
        for node, depth in enumerate(tree.depths):
            if depth < max_depth:
                for token, w in zip(tokens[node], weights[node]):
                    if (node, token) not in proposed:
                        parents.append(node)
                        leaf_tokens.append(token)
                        leaf_weights.append(w)
        return parents, leaf_tokens, leaf_weights

    @staticmethod
    def draft_leaves_arrays(tree: Tree, tokens: np.ndarray, weights: np.ndarray,
                            max_depth: int) -> tuple[list[int], list[int], list[float]]:
        above = np.flatnonzero(np.array(tree.depths) < max_depth)
        parents, tokens, weights = np.repeat(above, tokens.shape[1]), tokens[above].ravel(), weights[above].ravel()
        vocab = 1 + max(int(tokens.max(initial=0)), max(tree.tokens))
        keys = parents * vocab + tokens  # (parent, token) as one number; the trigram's own children likewise:
        proposed = np.sort(np.array(tree.parents, np.int64) * vocab + np.array(tree.tokens, np.int64))
        fresh = proposed[np.searchsorted(proposed, keys, side="right") - 1] != keys  # the root's key is below all
        return parents[fresh].tolist(), tokens[fresh].tolist(), weights[fresh].tolist()

    def sampled_tree(self, tree: Tree, logits: torch.Tensor, max_depth: int, generator) -> Tree:
        """When sampling: `draft_children` independent draws from the draft's q below the root and below
        every draw that lands on a node the draft scored (`tree`, whose q its one call computed), level by
        level, up to `budget` nodes; a draw elsewhere is a leaf. Verified by multi-draft rejection. Only the
        rows drawn below get a proposal: its top-k costs microseconds a row, and most of the scored nodes are
        never drawn. Draws that repeat a token each get draws below, so a confident path would multiply
        (3 draws a node: trees of thousands of nodes); the budget stops it at the first nodes of a level, in
        their order, which the earlier levels' draws decide before this level's are made: which nodes get
        draws never depends on the draws themselves, so multi-draft rejection stays exact."""
        count = self.draft_children or 2
        out, self.kept = Tree.rooted(tree.tokens[0]), [0]
        level = [(0, 0)]  # (node of `out`, the scored node it stands for): their children are drawn next
        while level := [(node, scored) for node, scored in level if out.depths[node] < max_depth][
                : (self.budget - len(out)) // count]:
            drawn, q = draw_children(self.sampling, logits[[scored for _, scored in level]], count,
                                     generator, self.draft.shortlist)
            below_level = []
            for (node, scored), tokens, dist in zip(level, drawn, q):
                out.child_dists[node] = dist
                below = {tree.tokens[c]: c for c in tree.children[scored]}
                for token in tokens:
                    child = out.add(node, token)
                    self.kept.append(below.get(token))
                    if token in below:
                        below_level.append((child, below[token]))
            level = below_level
        return out

    def propose(self, tokens: list[int], max_depth: int, generator) -> Tree:
        self.draft.start(tokens)
        tree, _ = self.trigram(tokens, max_depth)
        max_depth = min(max_depth, self.depth)
        copied = self.context.graft(tree, tokens, max_depth) if self.context is not None else set()
        n = len(tree)
        if self.sampled_children:
            return self.sampled_tree(tree, self.draft.score(tree, list(range(n))), max_depth, generator)
        # The copied continuation, likeliest to be accepted, takes the draft's first slots: accepted, it is in place.
        order = [0] + sorted(copied) + [node for node in range(1, n) if node not in copied]
        logits = self.draft.score(tree, order)
        if self.sampling.greedy and (self.draft_children or 1) == 1 and native.takes(logits):
            tokens, parents, self.kept = native.staged_selection(logits, order, tree.parents, tree.tokens, tree.depths,
                                                                 copied, self.draft.shortlist, max_depth, self.budget)
            return Tree.of(tokens, parents)
        tree, self.kept = self.selection(tree, logits, order, copied, max_depth)
        return tree

    def selection(self, tree: Tree, logits: torch.Tensor, order: list[int], copied: set[int],
                  max_depth: int) -> tuple[Tree, list[int]]:
        """The oracle's tree from the trigram's (and the context's) and the draft's logits after its nodes (row i
        after node order[i]): the `budget` candidates of highest cumulative draft weight among the tree's nodes
        and the draft's own best children, the `copied` nodes first; and for each node, the candidate it came from
        (n + i: the draft's leaf i). Greedy with one draft child, decode/native_step.cpp computes the same."""
        edges, best, best_weights = ranked_children(ranking_scores(logits, self.sampling), tree,
                                                    self.draft_children or 1, self.sampling.greedy, order,
                                                    self.draft.shortlist)
        cumulative = tree.cumulative(edges)
        leaf_parents, leaf_tokens, leaf_weights = self.draft_leaves(tree, best, best_weights, max_depth)
        candidates = cumulative + [cumulative[parent] * w for parent, w in zip(leaf_parents, leaf_weights)]
        if copied:  # the context's continuations go first, with the root above them
            for node in copied | {0}:
                candidates[node] += 1.0
        chosen = best_first(candidates, self.budget)  # candidate n + i is the draft's leaf i
        return Tree.chosen(tree.tokens + leaf_tokens, tree.parents + leaf_parents, chosen, candidates)


class ModelFreeDrafter:
    """A drafter without a draft model: no draft calls, nothing to commit."""

    sampled_children = False
    calls = 0

    def reset(self) -> None:
        pass

    def accept(self, path: list[int]) -> None:
        pass


class NgramDrafter(ModelFreeDrafter):
    """The trigram alone: nodes ranked by cumulative trigram probability."""

    def __init__(self, table, budget: int = 36, widths=(12, 7, 4, 1, 1, 1)):
        self.trigram, self.budget = TrigramTrees(table, widths), budget

    def propose(self, tokens: list[int], max_depth: int, generator) -> Tree:
        return self.trigram.best(tokens, max_depth, self.budget)


class LookupDrafter(ModelFreeDrafter):
    """The context alone: up to `branches` continuations of `length` tokens that followed the latest
    earlier occurrences of the longest suffix (of at most `max_ngram` tokens) seen before."""

    def __init__(self, length: int = 10, branches: int = 1, max_ngram: int = 3):
        self.length, self.branches, self.index = length, branches, ContextIndex(max_ngram)

    def reset(self) -> None:
        self.index.reset()

    def graft(self, tree: Tree, tokens: list[int], max_depth: int) -> set[int]:
        """Add the continuations below the root of `tree` (which stands for tokens[-1]); returns their nodes."""
        nodes = set()
        for chain in self.index.continuations(tokens, min(self.length, max_depth), self.branches):
            nodes.update(tree.add_path(chain))
        return nodes

    def propose(self, tokens: list[int], max_depth: int, generator) -> Tree:
        tree = Tree.rooted(tokens[-1])
        self.graft(tree, tokens, max_depth)
        return tree
