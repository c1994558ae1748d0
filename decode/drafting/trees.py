"""Trees of the draft model's own tokens: grown best-first (`TreeDrafter`), or a planned fixed shape filled a level
per draft call (`ShapedTreeDrafter`, Sequoia)."""
import torch

from decode.drafting.base import ModelDrafter
from decode.models.cached_lm import CachedLM
from decode.ranking import best_first, draw_children, ranking_scores, relative
from decode.sampling import Sampling, tokens_at
from decode.tree import Tree


class TreeDrafter(ModelDrafter):
    """The draft model grows a tree best-first: each forward pass expands the unexpanded nodes of
    highest cumulative probability (up to `expand` of them), `branch` children each, until the tree
    holds `budget` nodes or reaches `depth`. Children are the draft's top tokens (then the final tree
    is the best `budget` nodes, verified by sample-match) or, with `sampled=True`, independent
    samples from the draft (kept as drawn, verified by multi-draft rejection)."""

    def __init__(self, model: CachedLM, budget: int = 36, depth: int = 8, branch: int = 4,
                 expand: int = 4, sampled: bool = False):
        super().__init__(model, sampled)
        self.budget, self.depth, self.branch, self.expand = budget, depth, branch, expand

    def describe(self) -> dict:
        return {"budget": self.budget, "depth": self.depth, "branch": self.branch, "sampled": self.sampled}

    def _children(self, tree: Tree, cumulative: list[float], nodes: list[int], logits: torch.Tensor, sampling: Sampling,
                  generator) -> None:
        if self.draws(sampling):
            drawn, q = draw_children(self.kernels, sampling, logits, self.branch, generator, self.draft.shortlist)
            for node, tokens, row in zip(nodes, drawn, q):
                tree.child_dists[node] = row
                for token in tokens:
                    tree.add(node, token)
                    cumulative.append(cumulative[node] * float(row[token]))
            return
        top = ranking_scores(logits, sampling).topk(self.branch)
        for node, values, tokens in zip(nodes, top.values.tolist(), tokens_at(top.indices, self.draft.shortlist).tolist()):
            for p, token in zip(relative(values, values[0]) if sampling.greedy else values, tokens):
                tree.add(node, token)
                cumulative.append(cumulative[node] * p)

    def propose(self, tokens: list[int], max_depth: int, sampling: Sampling, generator) -> Tree:
        tree, cumulative = Tree.rooted(tokens[-1]), [1.0]
        self.kept = None
        self.draft.start(tokens)
        depth = min(self.depth, max_depth)
        if depth == 0:
            return tree
        self._children(tree, cumulative, [0], self.draft.score(tree, [0]), sampling, generator)
        expanded = {0}
        while len(tree) + self.branch <= (self.budget if self.draws(sampling) else 2 * self.budget):
            candidates = sorted((n for n in range(len(tree)) if n not in expanded and tree.depths[n] < depth),
                                key=lambda n: -cumulative[n])
            room = (self.budget - len(tree)) // self.branch if self.draws(sampling) else self.expand
            nodes = sorted(candidates[: min(self.expand, room)])
            if not nodes:
                break
            self._children(tree, cumulative, nodes, self.draft.score(tree, nodes), sampling, generator)
            expanded.update(nodes)
        if self.draws(sampling):  # sampled children stay as drawn: pruning by value would bias them
            return tree
        tree, self.kept = tree.subtree(best_first(cumulative, self.budget), cumulative)
        return tree


class ShapedTreeDrafter(ModelDrafter):
    """Sequoia's tree: a fixed shape filled with the draft's ranked tokens, one draft call per level.
    Node i of the shape hangs below `parents[i]` as its parent's rank-`ranks[i]` token (0: the
    draft's best); shape nodes come level by level. decode.plan chooses the shape (planning.best_shape).
    With `sampled` children (when sampling), a node's children in the shape are instead that many
    independent draws from the draft's q, verified by multi-draft rejection."""

    def __init__(self, model: CachedLM, parents: list[int], ranks: list[int],
                 sampled: bool = False):
        super().__init__(model, sampled)
        self.parents, self.ranks = list(parents), list(ranks)
        self.below: list[list[int]] = [[] for _ in self.parents]  # shape node -> its children in the shape
        for node, parent in enumerate(self.parents[1:], 1):
            self.below[parent].append(node)
        # shape node -> how many of the draft's ranked tokens its children read
        self.widest = [1 + max((self.ranks[c] for c in children), default=-1) for children in self.below]
        self.layouts: dict = {}
        # one child a node, the best or a draw: the chain drafter's tree, which the draft model may make in one call
        self.is_chain = all(len(children) <= 1 for children in self.below) and not any(self.ranks)

    def describe(self) -> dict:
        return {"nodes": len(self.parents), "sampled": self.sampled}

    def layout(self, max_depth: int) -> tuple[Tree, list[tuple[list[int], int, int, list[tuple[int, int, int, int]]]]]:
        """The tree a step grows at most `max_depth` levels deep (its tokens to be filled in) and, per level, the
        nodes the draft scores, the most ranked tokens and the most draws a row's children take, and each child as
        (node, its parent's row, its place among its siblings, its rank). Every step grows the same tree, so it is
        laid out once: growing it node by node a level at a time, right after a draft forward, cost every step."""
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

    def chain_steps(self, max_depth: int) -> int:
        return len(self.layout(max_depth)[1]) if self.is_chain else 0

    def propose(self, tokens: list[int], max_depth: int, sampling: Sampling, generator) -> Tree:
        if (call := self.chain_call(tokens, max_depth, sampling, generator)) is not None:
            return self.chained(call, call.run())
        shape, levels = self.layout(max_depth)
        tree = shape.copy([tokens[-1]] + shape.tokens[1:])
        for level, (nodes, widest, draws, children) in enumerate(levels):
            logits = self.draft.score(tree, nodes, repeats=(len(levels), level))
            if self.draws(sampling):  # child j of a node is its j-th independent draw
                drawn, q = draw_children(self.kernels, sampling, logits, draws, generator, self.draft.shortlist)
                tree.child_dists.update(zip(nodes, q))
                for node, row, place, _ in children:
                    tree.tokens[node] = drawn[row][place]
            else:  # child j is the draft's rank-ranks[j] token
                ranked = self.kernels.top_tokens(ranking_scores(logits, sampling), widest, self.draft.shortlist)
                for node, row, _, rank in children:
                    tree.tokens[node] = ranked[row][rank]
        return tree
