"""Katz backoff n-gram model with Good-Turing discounts (docs/trigram.md).

    P(w | h) = d_c c(h w) / c(h .)          if c(h w) > 0
             = alpha(h) P(w | h')            otherwise (h' drops the oldest symbol of h)

d_c is the Good-Turing discount for counts 1..k (counts above k keep d = 1), c(h .) the total count
of continuations of h, and alpha(h) gives the unseen continuations exactly the mass the discounts
freed, so every conditional distribution sums to one over the whole vocabulary: every token id and
`</s>` (`<s>` is only ever a history). The unigram level spreads its freed mass evenly over the
symbols never seen, so no token has probability zero.
"""
from dataclasses import dataclass, field

import numpy as np

from ngram.counts import NgramCounts, Vocabulary

LOG10_ZERO = -99.0  # ARPA's stand-in for log10(0): <s> and <unk> are never predicted
# A history whose continuations were all seen more than k times frees no mass: its backoff weight is 0.
# ARPA can only say 10^-99, so the model itself uses that floor and agrees with what kenlm reads.
MIN_ALPHA = 10.0**LOG10_ZERO
ZERO_PROB_LOG10 = LOG10_ZERO / 2  # scores below this are the floor's, counted as zero probabilities


def good_turing_discounts(counts: np.ndarray, k: int) -> tuple[np.ndarray, str | None]:
    """d_r for r = 0..k (index 0 unused) from counts-of-counts; all ones and a reason when degenerate."""
    n = np.bincount(counts, minlength=k + 2)[: k + 2].astype(np.float64)
    ones = np.ones(k + 1)
    if (n[1 : k + 2] == 0).any():
        return ones, f"a count-of-counts n_r is zero for r in 1..{k + 1}"
    r = np.arange(1, k + 1)
    r_star = (r + 1) * n[2 : k + 2] / n[1 : k + 1]
    a = (k + 1) * n[k + 1] / n[1]
    if a >= 1:
        return ones, f"(k+1) n_(k+1) / n_1 = {a:.3g} >= 1"
    d = (r_star / r - a) / (1 - a)
    if ((d <= 0) | (d > 1)).any():
        return ones, f"a discount falls outside (0, 1]: {np.round(d, 3).tolist()}"
    return np.concatenate([[1.0], d]), None


def _find(sorted_keys: np.ndarray, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(found mask, index) of keys in a sorted array."""
    idx = np.searchsorted(sorted_keys, keys)
    idx = np.minimum(idx, max(sorted_keys.size - 1, 0))
    found = sorted_keys[idx] == keys if sorted_keys.size else np.zeros(keys.shape, bool)
    return found, idx


@dataclass
class Level:
    """One order >= 2: seen n-grams with their probabilities, seen histories with their backoff weights."""

    keys: np.ndarray  # sorted n-gram keys
    prob: np.ndarray  # P(w | h) of each seen n-gram
    histories: np.ndarray  # sorted history keys with at least one continuation
    alpha: np.ndarray  # backoff weight of each history


@dataclass
class KatzModel:
    vocab: Vocabulary
    k: int
    unigram: np.ndarray  # P(w) for every symbol (0 for <s>)
    levels: list[Level] = field(default_factory=list)  # orders 2..N
    discounts: list[np.ndarray] = field(default_factory=list)  # per order, d_0..d_k
    notes: list[str] = field(default_factory=list)  # fallbacks taken while estimating

    @property
    def order(self) -> int:
        return 1 + len(self.levels)

    def prob(self, histories: np.ndarray, words: np.ndarray, order: int | None = None) -> np.ndarray:
        """P(w | h) for a batch: `histories` holds keys of (order - 1) symbols (base V + 2)."""
        order = self.order if order is None else order
        words = np.asarray(words, dtype=np.int64)
        if order == 1:
            return self.unigram[words]
        level = self.levels[order - 2]
        histories = np.asarray(histories, dtype=np.int64)
        found, idx = _find(level.keys, histories * self.vocab.base + words)
        p = np.where(found, level.prob[idx], 0.0)
        missing = ~found
        if missing.any():
            has_history, hidx = _find(level.histories, histories[missing])
            alpha = np.where(has_history, level.alpha[hidx], 1.0)
            shorter = histories[missing] % self.vocab.base ** (order - 2)
            p[missing] = alpha * self.prob(shorter, words[missing], order - 1)
        return p

    def sequence_log10(self, tokens: np.ndarray, order: int | None = None) -> np.ndarray:
        """log10 P of each symbol of `<s> tokens </s>` given its history (as kenlm scores a sentence)."""
        order = self.order if order is None else order
        base = self.vocab.base
        symbols = np.concatenate([[self.vocab.bos], np.asarray(tokens, np.int64), [self.vocab.eos]])
        if order == 1:
            return np.log10(self.unigram[symbols[1:]])
        out = np.empty(symbols.size - 1)
        for j in range(1, min(order - 1, symbols.size)):  # the first symbols have shorter histories
            out[j - 1] = np.log10(self.prob(history_keys(symbols[:j], j, base), symbols[j : j + 1], j + 1))[0]
        if symbols.size >= order:
            histories = history_keys(symbols[:-1], order - 1, base)
            out[order - 2 :] = np.log10(self.prob(histories, symbols[order - 1 :], order))
        return out

    def perplexity(self, documents: list[np.ndarray], order: int | None = None) -> tuple[float, int]:
        """Per-symbol perplexity over documents (each scored as <s> doc </s>, </s> included), and the
        number of zero-probability events, left out of the perplexity as SRILM does."""
        total, count, zeros = 0.0, 0, 0
        for doc in documents:
            scores = self.sequence_log10(doc, order)
            ok = scores > ZERO_PROB_LOG10
            total += scores[ok].sum()
            count += int(ok.sum())
            zeros += int((~ok).sum())
        return float(10 ** (-total / max(count, 1))), zeros


def history_keys(symbols: np.ndarray, width: int, base: int) -> np.ndarray:
    """Keys of every run of `width` consecutive symbols (oldest symbol most significant)."""
    m = symbols.size - width + 1
    keys = np.zeros(m, np.int64)
    for t in range(width):
        keys = keys * base + symbols[t : t + m]
    return keys


def _discount(c: np.ndarray, d: np.ndarray, k: int) -> np.ndarray:
    return np.where(c <= k, d[np.minimum(c, k).astype(int)], 1.0)


def _unigram(counts: NgramCounts, d: np.ndarray, k: int, notes: list[str]) -> np.ndarray:
    vocab = counts.vocab
    words, c = counts.keys[0], counts.counts[0].astype(np.float64)
    total = c.sum()
    seen = _discount(c, d, k) * c / total
    p = np.zeros(vocab.base)
    p[words] = seen
    unseen = np.ones(vocab.base, bool)
    unseen[words] = False
    unseen[vocab.bos] = False
    freed = 1.0 - seen.sum()
    if unseen.any() and freed <= 1e-12:
        n1 = float((c == 1).sum())
        freed = n1 / total if n1 else 1.0 / (total + 1)
        p[words] *= 1.0 - freed
        notes.append(f"order 1: no mass freed for unseen tokens; reserved {freed:.3g} (the singleton rate)")
    if unseen.any():
        p[unseen] = freed / unseen.sum()
    else:
        p /= p.sum()
    return p


def _level(model: KatzModel, counts: NgramCounts, n: int, d: np.ndarray) -> Level:
    base = model.vocab.base
    keys, c = counts.keys[n - 1], counts.counts[n - 1].astype(np.float64)
    histories_of = keys // base
    starts = np.flatnonzero(np.concatenate([[True], histories_of[1:] != histories_of[:-1]]))
    histories = histories_of[starts]
    group = np.repeat(np.arange(starts.size), np.diff(np.concatenate([starts, [keys.size]])))
    totals = np.add.reduceat(c, starts)
    prob = _discount(c, d, model.k) * c / totals[group]
    freed = 1.0 - np.add.reduceat(prob, starts)
    lower = model.prob(histories_of % base ** (n - 2), keys % base, n - 1)
    lower_unseen = 1.0 - np.add.reduceat(lower, starts)  # mass the lower order gives the unseen continuations
    covered = lower_unseen <= 1e-12  # seen continuations cover the whole vocabulary: nothing to back off to
    if covered.any():
        prob = np.where(covered[group], c / totals[group], prob)
        model.notes.append(f"order {n}: {int(covered.sum())} histories whose seen continuations hold all the lower order's mass; left undiscounted")
    alpha = np.where(covered, 0.0, np.clip(freed, 0.0, None) / np.where(covered, 1.0, lower_unseen))
    alpha = np.maximum(alpha, MIN_ALPHA)
    return Level(keys, prob, histories, alpha)


def estimate(counts: NgramCounts, k: int = 5) -> KatzModel:
    """Katz backoff model of the counts' order, bottom-up."""
    notes: list[str] = []
    discounts = []
    for n in range(1, counts.order + 1):
        d, reason = good_turing_discounts(counts.counts[n - 1], k)
        if reason:
            notes.append(f"order {n}: Good-Turing discounting disabled ({reason})")
        discounts.append(d)
    model = KatzModel(counts.vocab, k, _unigram(counts, discounts[0], k, notes), discounts=discounts, notes=notes)
    for n in range(2, counts.order + 1):
        model.levels.append(_level(model, counts, n, discounts[n - 1]))
    return model
