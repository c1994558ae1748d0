"""Drafters: each proposes a Tree rooted at the last accepted token for the oracle to verify.

    chain   the draft model samples k tokens one after another (standard speculative decoding)
    tree    the draft model expands the nodes of highest cumulative probability, a few children each
    staged  the Katz trigram proposes children level by level, the draft model scores all of them in
            one forward pass, and the best `budget` nodes by cumulative draft probability are kept
    ngram   the trigram alone, ranked by cumulative trigram probability

A drafter that uses the draft model keeps its KV cache on the accepted prefix: `propose` catches it
up on the tokens it has not seen and scores tree nodes as pending slots; `accept` commits the slots
of the accepted path.
"""
import itertools
import operator
import time

import torch

from decode.cached_lm import CachedLM
from decode.sampling import Sampling, sample
from decode.tree import Tree


class DraftModel:
    """The draft model's cache bookkeeping for one tree: which pending slot holds which node."""

    def __init__(self, model: CachedLM):
        self.model = model
        self.calls = 0

    def reset(self) -> None:
        self.model.reset()
        self.calls = 0

    def catch_up(self, tokens: list[int]) -> torch.Tensor:
        """Feed the accepted tokens the draft has not seen (the root last); logits at the root."""
        self.slots = {}  # tree node -> pending slot
        logits = self.model.append(torch.tensor(tokens[self.model.length :], device=self.model.device))
        self.slots[0] = self.model.pending - 1
        self.calls += 1
        return logits[-1]

    def score(self, tree: Tree, nodes: list[int]) -> torch.Tensor:
        """Logits of `nodes` (their ancestors already scored or among them), in one forward pass."""
        model = self.model
        cached, pending = model.length, model.pending
        ancestors = tree.ancestors()[nodes]  # (len(nodes), len(tree))
        mask = torch.zeros(len(nodes), cached + pending + len(nodes), dtype=torch.bool)
        mask[:, : cached + self.slots[0] + 1] = True  # the prefix, the catch-up run and the root
        fed = [n for n in self.slots if n != 0]
        if fed:
            mask[:, [cached + self.slots[n] for n in fed]] = ancestors[:, fed]
        mask[:, cached + pending :] = ancestors[:, nodes]
        for i, node in enumerate(nodes):
            self.slots[node] = pending + i
        self.calls += 1
        return model.forward(tree.token_ids(model.device)[nodes], tree.position_ids(cached + self.slots[0], model.device)[nodes],
                             mask.to(model.device))

    def accept(self, tree_path: list[int]) -> None:
        """Commit the catch-up run and the accepted nodes the draft has scored (a prefix of the path)."""
        keep = list(range(self.slots[0] + 1))
        for node in tree_path[1:]:
            if node not in self.slots:
                break
            keep.append(self.slots[node])
        self.model.commit(torch.tensor(keep, device=self.model.device))


def ranking_probs(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """What the drafters rank continuations by: the processed distribution, or the plain softmax when
    greedy (a point mass would rank only one child)."""
    return logits.float().softmax(-1) if sampling.greedy else sampling.probs(logits)


def top_nodes(cumulative, budget: int) -> list[int]:
    """The `budget` nodes of highest cumulative probability; ancestor-closed because a child never
    beats its parent (ties go to the earlier node, and parents come first)."""
    order = torch.sort(-torch.as_tensor(cumulative, dtype=torch.float64), stable=True).indices
    return sorted(order[:budget].tolist())


def best_budget(cumulative: torch.Tensor, oracle_ms: torch.Tensor, drafting_ms: float) -> int:
    """The oracle tree size with the most expected tokens per millisecond. A node is accepted with
    (about) its path probability under the draft, so the best b nodes yield the sum of their path
    probabilities (the root's 1 stands for the token the oracle adds); a step costs the drafting
    already spent plus the oracle's forward over b nodes (`oracle_ms[b]`, measured)."""
    best = cumulative.sort(descending=True).values[: len(oracle_ms) - 1]
    rate = best.cumsum(0) / (oracle_ms[1 : len(best) + 1] + drafting_ms)
    return int(rate.argmax()) + 1


def trigram_tree_size(widths: list[int]) -> int:
    """Nodes below the root of a trigram tree with these widths per level."""
    return sum(itertools.accumulate(widths, operator.mul))


def fit_widths(widths: list[int], draft_ms: torch.Tensor, limit_ms: float) -> list[int]:
    """Narrow the widest level, one child at a time, until the draft scores the trigram tree within
    `limit_ms` (`draft_ms[q]`: its measured forward cost for q nodes)."""
    widths = list(widths)
    while draft_ms[min(trigram_tree_size(widths), len(draft_ms) - 1)] > limit_ms and max(widths) > 1:
        widths[widths.index(max(widths))] -= 1
    return widths


class ModelDrafter:
    """A drafter that uses the draft model. `propose` builds the tree; when it prunes a larger tree,
    `kept` maps each proposed node to the node the draft model scored."""

    sampled_children = False

    def __init__(self, model: CachedLM, sampling: Sampling):
        self.draft, self.sampling = DraftModel(model), sampling
        self.kept = None

    def reset(self) -> None:
        self.draft.reset()

    @property
    def calls(self) -> int:
        return self.draft.calls

    def accept(self, path: list[int]) -> None:
        self.draft.accept([self.kept[n] for n in path] if self.kept is not None else path)


class ChainDrafter(ModelDrafter):
    """k tokens sampled from the draft model one after another (children drawn from q: rejection-verified)."""

    sampled_children = True

    def __init__(self, model: CachedLM, sampling: Sampling, k: int):
        super().__init__(model, sampling)
        self.k = k

    def propose(self, tokens: list[int], max_depth: int, generator) -> Tree:
        tree = Tree.rooted(tokens[-1])
        logits = self.draft.catch_up(tokens)
        node = 0
        for depth in range(min(self.k, max_depth)):
            q = self.sampling.probs(logits)
            tree.child_dists[node] = q
            node = tree.add(node, sample(q, generator))
            if depth + 1 < min(self.k, max_depth):
                logits = self.draft.score(tree, [node])[-1]
        return tree


class TreeDrafter(ModelDrafter):
    """The draft model grows a tree best-first: each forward pass expands the unexpanded nodes of
    highest cumulative probability (up to `expand` of them), `branch` children each, until the tree
    holds `budget` nodes or reaches `depth`. Children are the draft's top tokens (then the final tree
    is the best `budget` nodes, verified by sample-match) or, with `sampled=True`, independent
    samples from the draft (kept as drawn, verified by multi-draft rejection)."""

    def __init__(self, model: CachedLM, sampling: Sampling, budget: int = 36, depth: int = 8, branch: int = 4,
                 expand: int = 4, sampled: bool = False):
        super().__init__(model, sampling)
        self.budget, self.depth, self.branch, self.expand, self.sampled_children = budget, depth, branch, expand, sampled

    def _children(self, tree: Tree, cumulative: list[float], node: int, logits: torch.Tensor, generator) -> None:
        probs = ranking_probs(logits, self.sampling)
        if self.sampled_children:
            q = self.sampling.probs(logits)
            tree.child_dists[node] = q
            tokens = [sample(q, generator) for _ in range(self.branch)]
        else:
            tokens = probs.topk(self.branch).indices.tolist()
        for token in tokens:
            tree.add(node, token)
            cumulative.append(cumulative[node] * float(probs[token]))

    def propose(self, tokens: list[int], max_depth: int, generator) -> Tree:
        tree, cumulative = Tree.rooted(tokens[-1]), [1.0]
        self.kept = None
        depth = min(self.depth, max_depth)
        if depth == 0:
            self.draft.catch_up(tokens)
            return tree
        self._children(tree, cumulative, 0, self.draft.catch_up(tokens), generator)
        expanded = {0}
        while len(tree) + self.branch <= (self.budget if self.sampled_children else 2 * self.budget):
            candidates = sorted((n for n in range(len(tree)) if n not in expanded and tree.depths[n] < depth),
                                key=lambda n: -cumulative[n])
            room = (self.budget - len(tree)) // self.branch if self.sampled_children else self.expand
            nodes = sorted(candidates[: min(self.expand, room)])
            if not nodes:
                break
            for node, logits in zip(nodes, self.draft.score(tree, nodes)):
                self._children(tree, cumulative, node, logits, generator)
            expanded.update(nodes)
        if self.sampled_children:  # sampled children stay as drawn: pruning by value would bias them
            return tree
        tree, self.kept = tree.subtree(top_nodes(cumulative, self.budget))
        return tree


def trigram_tree(table, tokens: list[int], widths: list[int], max_depth: int) -> tuple[Tree, list[float]]:
    """Children proposed by the trigram, `widths[d]` per node at depth d; returns the tree and each
    node's trigram probability given its parent."""
    tree, probs = Tree.rooted(tokens[-1]), [1.0]
    level = [0]
    before_root = tokens[-2] if len(tokens) > 1 else table.bos
    for width in widths[:max_depth]:
        u = [tree.tokens[tree.parents[n]] if n else before_root for n in level]
        v = [tree.tokens[n] for n in level]
        successors, successor_probs = table.lookup(u, v)
        next_level = []
        for node, toks, ps in zip(level, successors[:, :width].tolist(), successor_probs[:, :width].tolist()):
            for token, p in zip(toks, ps):
                next_level.append(tree.add(node, token))
                probs.append(p)
        level = next_level
    return tree, probs


class StagedDrafter(ModelDrafter):
    """Staged speculative decoding: the trigram drafts for the draft model, which drafts for the oracle."""

    def __init__(self, model: CachedLM, table, sampling: Sampling, budget: int = 36, widths=(12, 7, 4, 1, 1, 1),
                 draft_children: int = 4, oracle_ms: torch.Tensor | None = None):
        """`oracle_ms[q]`, the oracle's measured cost for q nodes, makes `budget` a cap: each step keeps
        the number of nodes with the most expected tokens per millisecond (see best_budget)."""
        super().__init__(model, sampling)
        self.table, self.budget, self.widths, self.draft_children = table, budget, list(widths), draft_children
        self.oracle_ms = None if oracle_ms is None else oracle_ms[: budget + 1]

    def propose(self, tokens: list[int], max_depth: int, generator) -> Tree:
        start = time.perf_counter()
        root_logits = self.draft.catch_up(tokens)
        tree, _ = trigram_tree(self.table, tokens, self.widths, max_depth)
        n = len(tree)
        logits = torch.cat([root_logits[None], self.draft.score(tree, list(range(1, n)))]) if n > 1 else root_logits[None]
        probs = ranking_probs(logits, self.sampling)  # row i: the draft's distribution after node i
        parents, node_tokens = torch.tensor(tree.parents), torch.tensor(tree.tokens)
        cumulative = tree.cumulative(probs[parents.clamp_min(0), node_tokens])
        # the draft's own best children of every scored node are candidate leaves
        top_probs, top_tokens = probs.topk(self.draft_children)
        vocab = probs.shape[1]
        fresh = ~torch.isin(torch.arange(n)[:, None] * vocab + top_tokens, parents[1:] * vocab + node_tokens[1:])
        fresh &= (torch.tensor(tree.depths) < max_depth)[:, None]
        leaf_parents = torch.arange(n)[:, None].expand_as(top_tokens)[fresh]
        leaf_tokens = top_tokens[fresh]
        candidates = torch.cat([cumulative, cumulative[leaf_parents] * top_probs[fresh].double()])
        budget = self.budget
        if self.oracle_ms is not None:
            budget = best_budget(candidates, self.oracle_ms, 1e3 * (time.perf_counter() - start))
        chosen = top_nodes(candidates, budget)
        leaves = [tree.add(int(leaf_parents[i - n]), int(leaf_tokens[i - n])) for i in chosen if i >= n]
        tree, self.kept = tree.subtree([i for i in chosen if i < n] + leaves)
        return tree


class NgramDrafter:
    """The trigram alone: no draft model, nodes ranked by cumulative trigram probability."""

    sampled_children = False
    calls = 0

    def __init__(self, table, budget: int = 36, widths=(12, 7, 4, 1, 1, 1)):
        self.table, self.budget, self.widths = table, budget, list(widths)

    def reset(self) -> None:
        pass

    def propose(self, tokens: list[int], max_depth: int, generator) -> Tree:
        tree, probs = trigram_tree(self.table, tokens, self.widths, max_depth)
        return tree.subtree(top_nodes(tree.cumulative(torch.tensor(probs)), self.budget))[0]

    def accept(self, path: list[int]) -> None:
        pass
