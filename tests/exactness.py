"""Is a decoding method's output distribution the oracle's? Enumerate the exact distribution of the
first few tokens with a tiny vocabulary, sample the method many times, and run a chi-square test.

The bound: cells with an expected count below 5 are pooled; the statistic X with d degrees of
freedom becomes a z-score by the Wilson-Hilferty approximation ((X/d)^(1/3) is close to normal).
We reject at z > 3.7, a one-sided p of about 1e-4: with fixed seeds the test is deterministic, and a
correct method lands there by chance with probability about 1e-4 for a given seed. Power grows with
the number of samples: a rule that moves about 1.5 points of probability on the first token needs
tens of thousands of them (test_distribution.py measures its mutants at 20,000-40,000).
"""
import itertools
import math

import numpy as np
import torch

Z_LIMIT = 3.7


def exact_distribution(oracle, prompt: list[int], sampling, length: int) -> dict[tuple, float]:
    """P(first `length` tokens) under the oracle's processed distributions, by enumeration."""
    cache = {}

    def dist(prefix):
        if prefix not in cache:
            oracle.reset()
            cache[prefix] = sampling.probs(oracle.extend(torch.tensor(prompt + list(prefix)))[-1]).double().numpy()
        return cache[prefix]

    probs = {}
    for seq in itertools.product(range(oracle.vocab_size), repeat=length):
        p = 1.0
        for t in range(length):
            p *= dist(seq[:t])[seq[t]]
            if p == 0:
                break
        probs[seq] = p
    return probs


def chi_square_z(samples: list[tuple], probs: dict[tuple, float]) -> float:
    n = len(samples)
    counts = {}
    for s in samples:
        counts[s] = counts.get(s, 0) + 1
    if any(probs.get(s, 0.0) == 0 for s in counts):
        return math.inf  # an impossible outcome
    observed, expected, pooled_o, pooled_e = [], [], 0, 0.0
    for outcome, p in probs.items():
        if n * p >= 5:
            observed.append(counts.get(outcome, 0))
            expected.append(n * p)
        else:
            pooled_o += counts.get(outcome, 0)
            pooled_e += n * p
    if pooled_e > 0:
        observed.append(pooled_o)
        expected.append(pooled_e)
    observed, expected = np.array(observed), np.array(expected)
    x = float(((observed - expected) ** 2 / expected).sum())
    d = len(expected) - 1
    return ((x / d) ** (1 / 3) - (1 - 2 / (9 * d))) / math.sqrt(2 / (9 * d))
