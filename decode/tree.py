"""A tree of candidate continuations, scored by the oracle in one forward pass.

Node 0 is the root: the last accepted token, which the models have not seen yet. Nodes are in
topological order (a parent before its children). A node attends to every cached position and to
its own ancestors, itself included, and sits at position prefix length + depth.
"""
from dataclasses import dataclass, field

import torch


@dataclass
class Tree:
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)
    children: list[list[int]] = field(default_factory=list)
    # For drafters that sample children: the distribution each node's children were drawn from.
    child_dists: dict[int, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def rooted(cls, token: int) -> "Tree":
        return cls([token], [-1], [0], [[]])

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, parent: int, token: int) -> int:
        self.tokens.append(token)
        self.parents.append(parent)
        self.depths.append(self.depths[parent] + 1)
        self.children.append([])
        self.children[parent].append(len(self.tokens) - 1)
        return len(self.tokens) - 1

    def path(self, node: int) -> list[int]:
        """The nodes from the root to `node`."""
        nodes = []
        while node >= 0:
            nodes.append(node)
            node = self.parents[node]
        return nodes[::-1]

    def levels(self):
        """(depth, nodes at that depth, their parents) for depth 1, 2, ...: a level's parents are all
        in the level before, so per-node recurrences run one tensor operation per level."""
        parents, depths = torch.tensor(self.parents), torch.tensor(self.depths)
        for depth in range(1, max(self.depths) + 1):
            nodes = (depths == depth).nonzero()[:, 0]
            yield depth, nodes, parents[nodes]

    def ancestors(self) -> torch.Tensor:
        """(N, N) bool: [i, j] when j is i or one of its ancestors."""
        mask = torch.eye(len(self), dtype=torch.bool)
        for _, nodes, parents in self.levels():
            mask[nodes] |= mask[parents]
        return mask

    def cumulative(self, edge_probs: torch.Tensor) -> torch.Tensor:
        """Each node's path probability, the product of `edge_probs` (a node's probability given its
        parent; the root's entry is ignored) from the root down."""
        out = torch.ones(len(self), dtype=torch.float64)
        for _, nodes, parents in self.levels():
            out[nodes] = out[parents] * edge_probs[nodes].double()
        return out

    def attention_mask(self, cached: int, device=None) -> torch.Tensor:
        """(N, cached + N) bool: every cached position, then the node's ancestors and itself."""
        return torch.cat([torch.ones(len(self), cached, dtype=torch.bool), self.ancestors()], 1).to(device)

    def position_ids(self, prefix: int, device=None) -> torch.Tensor:
        return prefix + torch.tensor(self.depths, device=device)

    def token_ids(self, device=None) -> torch.Tensor:
        return torch.tensor(self.tokens, device=device)

    def subtree(self, nodes: list[int]) -> tuple["Tree", list[int]]:
        """The tree restricted to `nodes` (which must hold every ancestor of each), renumbered in
        topological order; returns it and, for each new node, its old index."""
        keep = sorted(nodes)
        new_index = {old: new for new, old in enumerate(keep)}
        tree = Tree.rooted(self.tokens[keep[0]])
        for old in keep[1:]:
            tree.add(new_index[self.parents[old]], self.tokens[old])
        tree.child_dists = {new_index[o]: d for o, d in self.child_dists.items() if o in new_index}
        return tree, keep
