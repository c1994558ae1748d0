"""A tree of candidate continuations, scored by the oracle in one forward pass.

Node 0 is the root: the last accepted token, which the models have not seen yet. Nodes are in
topological order (a parent before its children). A node attends to every cached position and to
its own ancestors, itself included, and sits at position prefix length + depth.

Trees the oracle scores hold tens of nodes and are built once per step, so they live in Python lists:
a torch operation costs microseconds of dispatch, a list append a fraction of that. Each node carries
its ancestors as the bits of a Python integer, unpacked into a mask by one numpy call. What runs over
every node of a drafter's larger trees (the staged trigram tree: up to 1,441 nodes) is array code.
"""
import functools
from dataclasses import dataclass, field

import numpy as np
import torch

from decode.tensors import on


def unpack_rows(rows: list[int] | tuple[int, ...], width: int) -> np.ndarray:
    """(len(rows), width) bool: bit j of rows[i] at [i, j]."""
    nbytes = (width + 7) // 8
    packed = np.frombuffer(b"".join(bits.to_bytes(nbytes, "little") for bits in rows), np.uint8)
    return np.unpackbits(packed.reshape(len(rows), nbytes), axis=1, count=width, bitorder="little").view(bool)


@functools.lru_cache(maxsize=1 << 12)
def rows_mask(rows: tuple[int, ...], width: int, device=None) -> torch.Tensor:
    """unpack_rows as a tensor on `device` (an attention mask), remembered: trees repeat their shapes (the
    staged oracle's, chosen from a trigram tree of one shape, mostly do). Shared: never written to."""
    return on(torch.from_numpy(unpack_rows(rows, width)), device)


@dataclass
class Tree:
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)
    children: list[list[int]] = field(default_factory=list)
    lineage: list[int] = field(default_factory=list)  # bit j of lineage[i]: j is i or one of its ancestors
    # For drafters that sample children: the distribution each node's children were drawn from (a row over the
    # vocabulary, or Sparse under top-k sampling).
    child_dists: dict = field(default_factory=dict)

    @classmethod
    def rooted(cls, token: int) -> "Tree":
        return cls([token], [-1], [0], [[]], [1])

    def copy(self, tokens: list[int] | None = None) -> "Tree":
        """A copy to grow; with `tokens`, a tree of this shape that holds them instead."""
        return Tree(list(self.tokens if tokens is None else tokens), self.parents[:], self.depths[:],
                    [c[:] for c in self.children], self.lineage[:], dict(self.child_dists))

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, parent: int, token: int) -> int:
        node = len(self.tokens)
        self.tokens.append(token)
        self.parents.append(parent)
        self.depths.append(self.depths[parent] + 1)
        self.children.append([])
        self.children[parent].append(node)
        self.lineage.append(self.lineage[parent] | 1 << node)
        return node

    def add_level(self, parents: list[int], tokens: list[int]) -> range:
        """Add children (parents[i], tokens[i]) for every i; returns their node numbers."""
        first = len(self.tokens)
        for parent, token in zip(parents, tokens):
            self.add(parent, token)
        return range(first, len(self.tokens))

    def add_path(self, tokens: list[int], node: int = 0) -> list[int]:
        """Follow or grow the branch below `node` that spells `tokens`; returns its nodes."""
        nodes = []
        for token in tokens:
            child = next((c for c in self.children[node] if self.tokens[c] == token), None)
            node = self.add(node, token) if child is None else child
            nodes.append(node)
        return nodes

    def path(self, node: int) -> list[int]:
        """The nodes from the root to `node`."""
        nodes = []
        while node >= 0:
            nodes.append(node)
            node = self.parents[node]
        return nodes[::-1]

    def mask(self, device=None) -> torch.Tensor:
        """(N, N) bool: what each node sees among the tree's nodes (the cache it sees whole)."""
        return rows_mask(tuple(self.lineage), len(self), device)

    def positions(self, prefix: int) -> list[int]:
        """Each node's position after `prefix` cached ones. A forward takes its tokens and positions as lists: on a
        CPU the C++ forward reads lists, and a tensor made for it would be read back into one."""
        return [prefix + depth for depth in self.depths]

    def cumulative(self, edge_probs) -> list[float]:
        """Each node's path probability, the product of `edge_probs` (a node's probability given its
        parent; the root's entry is ignored) from the root down."""
        out = [1.0] * len(self)
        for node in range(1, len(self)):
            out[node] = out[self.parents[node]] * edge_probs[node]
        return out

    def subtree(self, nodes, scores=None) -> tuple["Tree", list[int]]:
        """The tree restricted to `nodes` (which must hold the root and every ancestor of each), renumbered
        depth first with each node's children by descending `scores` (default: in their order), so the
        likeliest path is nodes 0, 1, 2, ...: when the oracle accepts it, its cache slots are already in place.
        Returns the tree and, for each new node, its old index."""
        tree, keep = Tree.chosen(self.tokens, self.parents, nodes, scores)
        tree.child_dists = {new: self.child_dists[old] for new, old in enumerate(keep) if old in self.child_dists}
        return tree, keep

    @staticmethod
    def chosen(tokens: list[int], parents: list[int], nodes, scores=None) -> tuple["Tree", list[int]]:
        """`subtree` of the tree that node i's token and parent, tokens[i] and parents[i], describe: a
        drafter's candidates can be chosen from without first being added to a tree."""
        below: dict[int, list[int]] = {}
        for node in sorted(nodes)[1:]:  # children in their order, as `add` numbered them
            below.setdefault(parents[node], []).append(node)
        keep, stack = [], [0]
        while stack:
            node = stack.pop()
            keep.append(node)
            if node in below:
                children = below[node]
                if scores is not None:
                    children.sort(key=scores.__getitem__, reverse=True)  # stable: ties keep their order, as in best_first
                stack += reversed(children)
        new_index = {old: new for new, old in enumerate(keep)}
        return Tree.of([tokens[old] for old in keep], [-1] + [new_index[parents[old]] for old in keep[1:]]), keep

    @classmethod
    def of(cls, tokens: list[int], parents: list[int]) -> "Tree":
        """The tree whose node i holds tokens[i] below parents[i] (parents before their children)."""
        tree = cls.rooted(tokens[0])
        for parent, token in zip(parents[1:], tokens[1:]):
            tree.add(parent, token)
        return tree


@dataclass
class Shape:
    """A static tree of ranks: node i hangs below parents[i] as its rank-ranks[i] candidate."""

    parents: list[int]
    ranks: list[int]
    expected: float  # accepted nodes per step predicted by the rates it was built from

    @property
    def depth(self) -> int:
        depths = [0] * len(self.parents)
        for node, parent in enumerate(self.parents[1:], 1):
            depths[node] = depths[parent] + 1
        return max(depths)
