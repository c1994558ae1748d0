"""The Katz trigram's trees below a context (`TrigramTrees`), and the drafter that proposes them alone."""
import numpy as np

from decode.drafting.base import ModelFreeDrafter
from decode.drafting.draft_cache import remember
from decode.models.runtime import host_kernels
from decode.ranking import best_first
from decode.sampling import Sampling
from decode.tree import Tree


class TrigramTrees:
    """The trigram's tree below a context, `widths[d]` children per node at depth d. Every such tree has
    the same shape (the table keeps at least max(widths) successors of every context), so a context's tree
    is its tokens and probabilities, a gather a level, laid on the shape. A tree depends only on
    the last two tokens, so each is built once and remembered, up to `size` of them: code repeats its
    contexts. Callers get a copy to grow; `best`, the trigram's own selection, is remembered too."""

    def __init__(self, table, widths, size: int = 1 << 14):
        self.table, self.widths, self.size = table, list(widths), size
        self.shapes: dict[int, Tree] = {}
        self.built: dict[tuple, tuple[list[int], list[float]]] = {}
        self.selected: dict[tuple, Tree] = {}
        self.read = host_kernels().trigram_reader(table)

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
        """`Tree.cumulative` on the shape `depth` levels deep, a level at a time."""
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
            tree, level = Tree.rooted(0), range(1)  # the root
            for width in self.widths[:depth]:
                level = tree.add_level([n for n in level for _ in range(width)], [0] * (len(level) * width))
            self.shapes[depth] = tree
        return self.shapes[depth]

    def build(self, before_root: int, root: int, depth: int) -> tuple[list[int], list[float]]:
        """The tokens and probabilities of the tree's nodes, in the shape's order (StepKernels.trigram_reader)."""
        return self.read(before_root, root, self.widths[:depth])


class NgramDrafter(ModelFreeDrafter):
    """The trigram alone: nodes ranked by cumulative trigram probability."""

    def __init__(self, table, budget: int = 36, widths=(12, 7, 4, 1, 1, 1)):
        self.trigram, self.budget = TrigramTrees(table, widths), budget

    def propose(self, tokens: list[int], max_depth: int, sampling: Sampling, generator) -> Tree:
        return self.trigram.best(tokens, max_depth, self.budget)

    def forget(self) -> None:
        self.trigram.forget()

    def describe(self) -> dict:
        return {"widths": self.trigram.widths, "budget": self.budget}
