"""The processed distribution the output must follow: temperature, then top-k, then top-p.

Temperature 0 means greedy: the distribution is a point mass on the argmax, so the same exact
verification rules serve greedy decoding (they reduce to "accept while the token is the argmax").
"""
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from decode.shortlist import Shortlist

# Sampling with a top-k up to this many tokens holds its distributions as Sparse. Past it, reading a row's support
# (the k largest logits, kept in order) cost more than torch's passes over the row (8,192 logits on a CPU).
SPARSE_SUPPORT = 128


class Sparse(dict):
    """A distribution over a few tokens, {token: probability} (likeliest first as read from logits); any other
    token's probability is 0. Top-k sampling's distributions live on at most k tokens: on a CPU, reading and drawing
    from them here costs a few microseconds, where each torch operation over a vocabulary-wide row costs tens."""

    def __missing__(self, token: int) -> float:
        return 0.0

    def draw(self, uniform: float) -> int:
        """The token at `uniform` (in [0, 1)) of the cumulative probabilities, in the dict's order."""
        for token, probability in self.items():
            uniform -= probability
            if uniform < 0:
                return token
        return token  # rounding left the sum a hair under `uniform`: the last token


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def sparse(self) -> bool:
        """Whether its distributions live on a few tokens (a top-k up to SPARSE_SUPPORT): `distributions` gives them."""
        return not self.greedy and 0 < self.top_k <= SPARSE_SUPPORT

    def describe(self) -> str:
        """The setting as benchmarks and plans name it."""
        return "greedy" if self.greedy else f"T={self.temperature} top-k {self.top_k} top-p {self.top_p}"

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """Processed next-token distributions for logits (..., vocab)."""
        if self.greedy:
            return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
        logits = logits.float() / self.temperature
        if self.top_k:
            kth = logits.topk(min(self.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if self.top_p < 1.0:
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            sorted_probs = sorted_logits.softmax(-1)
            drop = sorted_probs.cumsum(-1) - sorted_probs >= self.top_p  # the mass before it already reaches p
            logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
        return logits.softmax(-1)

    def distributions(self, logits: torch.Tensor, rows: list[int] | None = None,
                      shortlist: Shortlist | None = None) -> list[Sparse]:
        """The processed distribution after each of `rows` of the logits (default: every row) as Sparse (with a
        shortlist, the logits' columns are its tokens): `probs` over the vocabulary, read back once. For `sparse`
        settings; decode.kernels reads them off the logits where it can."""
        rows = list(range(logits.shape[0])) if rows is None else rows
        out = []
        for row in self.probs(logits[rows]).double().cpu().numpy():
            columns = np.flatnonzero(row)
            columns = columns[np.argsort(-row[columns], kind="stable")]
            tokens = columns if shortlist is None else shortlist.tokens[columns]
            out.append(Sparse(zip(tokens.tolist(), row[columns].tolist())))
        return out

    def proposal(self, logits: torch.Tensor, cap: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
        """A draft's distribution as a proposal that is cheap to draw from: the processed distribution over
        each row's K likeliest tokens (K: top_k, at most `cap`), renormalised. Rejection sampling stays exact
        for any proposal it checks against, and this one skips the passes over the whole vocabulary (torch's top-k,
        mask and softmax, each a pass over every logit of a row). (probs, tokens), (..., K)."""
        top = logits.float().topk(min(self.top_k or cap, cap, logits.shape[-1]), dim=-1)
        if self.top_p == 1.0 and not self.greedy:  # top-k over K <= top_k values keeps them all: what probs does
            return (top.values / self.temperature).softmax(-1), top.indices
        return self.probs(top.values), top.indices


GREEDY = Sampling()  # greedy decoding, the default setting


def top_tokens(logits: torch.Tensor, k: int = 1, shortlist: Shortlist | None = None) -> np.ndarray:
    """(rows, k): each row's k largest tokens, best first (with a shortlist, the logits' columns are its tokens).
    The argmax on CPU goes through numpy, whose argmax over a vocabulary runs several times faster than torch's CPU
    argmax. Ties go to the first index for k = 1."""
    if k == 1 and logits.is_cpu and logits.dtype == torch.float32:
        best = logits.numpy().argmax(1)[:, None]
    else:
        best = (logits.argmax(-1, keepdim=True) if k == 1 else logits.topk(k).indices).cpu().numpy()
    return best if shortlist is None else shortlist.tokens[best]


def values_at(logits: torch.Tensor, rows, tokens, shortlist: Shortlist | None = None) -> np.ndarray:
    """logits[rows[i], tokens[i]] for every i; with a shortlist, the column of each token, and -inf for a token
    off it. On CPU in float32 numpy reads them: right after a model's forward, a torch call costs tens of
    microseconds there, a numpy gather a few."""
    if shortlist is not None:
        columns = shortlist.column[np.asarray(tokens, np.int64)]
        return np.where(columns >= 0, values_at(logits, rows, np.maximum(columns, 0)), -np.inf)
    if logits.is_cpu and logits.dtype == torch.float32:
        return logits.numpy()[rows, tokens]
    flat = np.asarray(rows, np.int64) * logits.shape[-1] + np.asarray(tokens, np.int64)
    return logits.take(torch.from_numpy(flat).to(logits.device)).float().cpu().numpy()


def tokens_at(columns: torch.Tensor, shortlist: Shortlist | None) -> torch.Tensor:
    """The tokens that these columns of a model's logits stand for (the columns themselves without a shortlist)."""
    return columns if shortlist is None else shortlist.tokens_at(columns)


def argmax_of_rows(logits: torch.Tensor) -> Callable[[int], int]:
    """row -> the argmax of that row of `logits`. On CPU a row is read when asked for (verification
    visits a few of a tree's rows, and right after the forward that wrote them reading a row pays for caches the
    forward evicted); elsewhere every row at once, one transfer."""
    if logits.is_cpu and logits.dtype == torch.float32:
        rows = logits.numpy()
        return lambda row: int(rows[row].argmax())
    return top_tokens(logits).ravel().tolist().__getitem__


class Uniforms:
    """Uniform draws in [0, 1) (float64) from a torch generator (None: torch's default one), read from it a block at a
    time and handed out in order: each read of the generator is a torch call (on a GPU, a transfer as well), tens of
    microseconds right after a model's forward on a CPU, and a sampled step draws several times. The decoding loops
    draw through one made from the generator they are given: it is the `generator` that drafters, verification
    rules and `Sampling.choose` take."""

    BLOCK = 256

    def __init__(self, generator: torch.Generator | None = None):
        self.generator = generator
        self.values: list[float] = []
        self.next = 0

    def take(self, count: int) -> list[float]:
        """The next `count` draws."""
        draws = self.peek(count)
        self.next += count
        return draws

    def peek(self, count: int) -> list[float]:
        """The next `count` draws, left to be taken: a rule that reads an unknown number of them up to `count` (the
        C++ loops) takes as many as it read with `skip`."""
        if self.next + count > len(self.values):
            device = self.generator.device if self.generator is not None else None
            fresh = torch.rand(max(self.BLOCK, count), dtype=torch.float64, generator=self.generator, device=device)
            self.values, self.next = self.values[self.next :] + fresh.tolist(), 0
        return self.values[self.next : self.next + count]

    def skip(self, count: int) -> None:
        """Take the next `count` draws (a `peek` read them)."""
        self.next += count


def draw(probs: torch.Tensor | Sparse, generator: Uniforms) -> int:
    """One token from a distribution, vocabulary-wide (`sample`) or Sparse."""
    return probs.draw(generator.take(1)[0]) if isinstance(probs, Sparse) else sample(probs, generator)


def sample(probs: torch.Tensor, generator: Uniforms) -> int:
    """One token from a distribution (`inverse_cdf` at a uniform draw): torch.multinomial draws one exponential per
    token of the vocabulary, and the baseline samples every token this way."""
    return int(inverse_cdf(probs, generator.take(1)[0]))


def inverse_cdf(probs: torch.Tensor, points: float | torch.Tensor) -> torch.Tensor:
    """The columns at `points` of the distributions in the last dimension of `probs` (one uniform draw in [0, 1), or
    a tensor of draws per row): each row's cumulative sum inverted, in float64 (the sum's rounding stays far below
    any probability that matters); a point that rounds onto the total takes the last column."""
    cumulative = probs.double().cumsum(-1)
    return torch.searchsorted(cumulative, cumulative[..., -1:] * points, right=True).clamp_max_(probs.shape[-1] - 1)
