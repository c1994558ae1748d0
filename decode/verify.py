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
