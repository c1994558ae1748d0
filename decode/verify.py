"""Exact verification of a drafted chain (Chen et al. 2023, modified rejection sampling).

p: the oracle's processed distributions at the K + 1 positions, q: the draft's at the K drafted
positions, drafted: the K tokens the draft sampled from q. Accept token i with probability
min(1, p_i(x) / q_i(x)); at the first rejection sample from normalise(max(p_i - q_i, 0)); when all K
pass, sample a bonus token from p_K. The emitted tokens then follow p exactly. With point masses
(greedy) this is: accept while the drafted token is the oracle's argmax, then take the argmax.
"""
import torch

from decode.sampling import sample


def verify_chain(p: torch.Tensor, q: torch.Tensor, drafted: torch.Tensor, generator) -> tuple[int, int]:
    """(number of drafted tokens accepted, the token that follows them)."""
    k = drafted.numel()
    idx = torch.arange(k)
    u = torch.rand(k, generator=generator)
    accepted = u * q[idx, drafted] < p[idx, drafted]  # u < p/q without dividing; q(x) > 0 as x was drawn from q
    n = int(accepted.cumprod(0).sum())
    if n == k:
        return n, sample(p[k], generator)
    residual = (p[n] - q[n]).clamp_min(0)
    return n, sample(residual if residual.sum() > 0 else p[n], generator)


def sample_match(tree, p: torch.Tensor, generator) -> tuple[list[int], int]:
    """Exact for any tree that does not depend on the oracle's randomness: at each node sample the
    oracle's token from p; descend into the child that carries it, else emit it and stop.
    Returns the accepted nodes (the root first) and the token that follows them."""
    path = [0]
    while True:
        token = sample(p[path[-1]], generator)
        child = next((c for c in tree.children[path[-1]] if tree.tokens[c] == token), None)
        if child is None:
            return path, token
        path.append(child)


def multi_draft_rejection(tree, p: torch.Tensor, generator) -> tuple[list[int], int]:
    """SpecInfer's multi-round rejection sampling, for trees whose children at a node were drawn
    independently from `tree.child_dists[node]`: try the children in order, accepting child x with
    probability min(1, r(x) / q(x)) where r starts as p and becomes normalise(max(r - q, 0)) after
    each rejection; if every child is rejected, sample from r. On a chain this is Chen et al.'s rule."""
    path = [0]
    while True:
        node = path[-1]
        residual = p[node]
        for child in tree.children[node]:
            q = tree.child_dists[node]
            x = tree.tokens[child]
            if float(torch.rand(1, generator=generator)) * q[x] < residual[x]:
                path.append(child)
                break
            left = (residual - q).clamp_min(0)
            residual = left / left.sum() if left.sum() > 0 else residual
        else:
            return path, sample(residual, generator)
