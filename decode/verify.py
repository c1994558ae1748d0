"""Exact verification of a drafted tree: the emitted tokens follow the oracle's processed
distribution p exactly. Both rules take the tree and the oracle's Target (p at every node) and
return the accepted nodes (the root first) and the token that follows them. These are the rules as the portable
kernels run them (decode.kernels); the C++ loops walk a tree the same way where they read the logits.

On a chain, multi-draft rejection is Chen et al.'s modified rejection sampling: accept the drafted
token with probability min(1, p(x) / q(x)), on rejection sample from normalise(max(p - q, 0)), and
after the last drafted token sample a bonus token from p. With point masses (greedy decoding) both
rules reduce to: follow the child that carries the oracle's argmax, then emit the argmax.
"""
import functools
from collections.abc import Callable

import torch

from decode.sampling import Sampling, Sparse, Uniforms, argmax_of_rows, draw


class Target:
    """The oracle's processed distribution p at each node of a scored tree, computed only at the
    nodes verification visits (greedy: the row's argmax; top-k sampling: Sparse)."""

    def __init__(self, logits: torch.Tensor, sampling: Sampling):
        self.logits, self.sampling = logits, sampling
        self._probs: dict[int, torch.Tensor | Sparse] = {}

    @functools.cached_property
    def argmax(self) -> Callable[[int], int] | None:
        """row -> its argmax when greedy (None when sampling): made when first asked for."""
        return argmax_of_rows(self.logits) if self.sampling.greedy else None

    def probs(self, node: int) -> torch.Tensor | Sparse:
        if node not in self._probs:
            self._probs[node] = (self.sampling.distributions(self.logits, [node])[0] if self.sampling.sparse
                                 else self.sampling.probs(self.logits[node]))
        return self._probs[node]

    def draw(self, node: int, generator: Uniforms) -> int:
        """A token from p at `node` (its argmax when greedy: a point mass needs no random draw)."""
        return self.argmax(node) if self.argmax is not None else draw(self.probs(node), generator)


def sample_match(tree, target: Target, generator: Uniforms) -> tuple[list[int], int]:
    """Exact for any tree that does not depend on the oracle's randomness: at each node sample the
    oracle's token from p; descend into the child that carries it, else emit it and stop.
    Returns the accepted nodes (the root first) and the token that follows them."""
    path = [0]
    while True:
        token = target.draw(path[-1], generator)
        child = next((c for c in tree.children[path[-1]] if tree.tokens[c] == token), None)
        if child is None:
            return path, token
        path.append(child)


def remainder(residual: torch.Tensor | Sparse, q: torch.Tensor | Sparse) -> torch.Tensor | Sparse:
    """normalise(max(residual - q, 0)): what is left to sample once a draw from q is rejected (residual itself
    where q covers all of it)."""
    if isinstance(residual, Sparse):
        left = {token: r - q[token] for token, r in residual.items() if r > q[token]}
        total = sum(left.values())
        return Sparse({token: r / total for token, r in left.items()}) if total > 0 else residual
    assert isinstance(q, torch.Tensor), "a dense residual's draft distribution is dense too"
    dense = (residual - q).clamp_min(0)
    total = dense.sum()
    return dense / total if total > 0 else residual


def multi_draft_rejection(tree, target: Target, generator: Uniforms) -> tuple[list[int], int]:
    """SpecInfer's multi-round rejection sampling, for trees whose children at a node were drawn
    independently from `tree.child_dists[node]`: try the children in order, accepting child x with
    probability min(1, r(x) / q(x)) where r starts as p and becomes normalise(max(r - q, 0)) after
    each rejection; if every child is rejected, sample from r. On a chain this is Chen et al.'s rule."""
    path = [0]
    while True:
        node = path[-1]
        residual, q = target.probs(node), tree.child_dists.get(node)
        for child in tree.children[node]:
            x = tree.tokens[child]
            if generator.take(1)[0] * q[x] < residual[x]:
                path.append(child)
                break
            residual = remainder(residual, q)
        else:
            return path, draw(residual, generator)
