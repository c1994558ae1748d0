"""Top-K successor tables: the draft-of-the-draft's fast path.

For every seen trigram history (u, v), every history symbol v and the unigram level, the K most
probable next tokens under the full Katz model with their probabilities. A batch of contexts is one
searchsorted and a gather. `</s>` is returned as the tokenizer's end-of-text id.
"""
import dataclasses
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from data.atomic import atomic_output
from data.errors import InputError, first_line
from ngram.katz import KatzModel

ROW_CHUNK = 512  # histories per dense block when ranking a whole row
EXTRA_CANDIDATES = 48  # lower-order candidates kept beyond K; rows with more seen overlap fall back to exact


@dataclass
class SuccessorTable:
    vocab_size: int
    eos_id: int
    unigram_tokens: np.ndarray  # (K,)
    unigram_probs: np.ndarray  # (K,)
    bigram_tokens: np.ndarray  # (V + 2, K): a row per history symbol (unseen histories: the unigram row)
    bigram_probs: np.ndarray
    trigram_histories: np.ndarray  # (H,) sorted keys u * (V + 2) + v
    trigram_tokens: np.ndarray  # (H, K)
    trigram_probs: np.ndarray

    @property
    def bos(self) -> int:
        return self.vocab_size

    @property
    def k(self) -> int:
        return self.unigram_tokens.size

    def lookup(self, u: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Top-K next tokens and probabilities after each context (u, v); u may be `bos` (start of text)."""
        keys = np.asarray(u, np.int64) * (self.vocab_size + 2) + v
        idx = np.minimum(self.trigram_histories.searchsorted(keys), self.trigram_histories.size - 1)
        tokens, probs = self.trigram_tokens[idx], self.trigram_probs[idx]
        unseen = self.trigram_histories[idx] != keys  # back off to the bigram row of v
        if unseen.any():
            tokens[unseen], probs[unseen] = self.bigram_tokens[v[unseen]], self.bigram_probs[v[unseen]]
        return tokens, probs

    @classmethod
    def field_names(cls) -> list[str]:
        """The arrays a table is saved as."""
        return [f.name for f in dataclasses.fields(cls) if f.init]

    def save(self, path) -> None:
        with atomic_output(path) as tmp:
            with open(tmp, "wb") as f:
                np.savez(f, **{name: np.asarray(getattr(self, name)) for name in self.field_names()})

    @classmethod
    def load(cls, path) -> "SuccessorTable":
        path = Path(path)
        if not path.is_file():
            raise InputError(f"no successor table at {path}; build one with `python ngram/build_katz.py --out {path.parent}`")
        try:
            with np.load(path, allow_pickle=False) as z:
                fields = {k: z[k] for k in z.files}
        except Exception as err:  # BadZipFile, truncated members, not an npz at all
            raise InputError(f"{path} is damaged ({first_line(err)}); rebuild it with "
                             f"`python ngram/build_katz.py --out {path.parent} --overwrite`") from None
        expected = set(cls.field_names())
        if set(fields) != expected:
            raise InputError(f"{path} is not a successor table (fields {sorted(fields)}); rebuild it with "
                             f"`python ngram/build_katz.py --out {path.parent} --overwrite`")
        return cls(**{k: (int(v) if v.ndim == 0 else v) for k, v in fields.items()})


def _top(probs: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Column indices and values of the k largest entries of each row, largest first."""
    k = min(k, probs.shape[1])
    part = np.argpartition(-probs, k - 1, axis=1)[:, :k]
    vals = np.take_along_axis(probs, part, 1)
    order = np.argsort(-vals, axis=1, kind="stable")
    return np.take_along_axis(part, order, 1), np.take_along_axis(vals, order, 1)


def _bigram_rows(model: KatzModel, histories: np.ndarray) -> np.ndarray:
    """The full bigram-level distribution P(. | v) for each history symbol v: (len, V + 2)."""
    level = model.levels[0]
    base = model.vocab.base
    idx = np.searchsorted(level.histories, histories).clip(max=level.histories.size - 1)
    alpha = np.where(level.histories[idx] == histories, level.alpha[idx], 1.0)
    rows = alpha[:, None] * model.unigram[None, :]
    lo, hi = np.searchsorted(level.keys, histories * base), np.searchsorted(level.keys, (histories + 1) * base)
    for r, (a, b) in enumerate(zip(lo.tolist(), hi.tolist())):
        rows[r, level.keys[a:b] % base] = level.prob[a:b]
    return rows


def _grouped_top(keys: np.ndarray, probs: np.ndarray, starts: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Per history group (sorted keys, group starts), the k most probable seen words: (H, k), padded with -1."""
    group = np.repeat(np.arange(starts.size), np.diff(np.concatenate([starts, [keys.size]])))
    order = np.lexsort((-probs, group))
    rank = np.arange(keys.size) - starts[group[order]]
    keep = order[rank < k]
    tokens = np.full((starts.size, k), -1, np.int64)
    values = np.full((starts.size, k), -1.0)
    tokens[group[keep], rank[rank < k]] = keys[keep]
    values[group[keep], rank[rank < k]] = probs[keep]
    return tokens, values


def build(model: KatzModel, k: int, eos_id: int) -> SuccessorTable:
    """Exact top-K tables for a trigram model (ties aside)."""
    vocab, base = model.vocab, model.vocab.base
    if model.order != 3:
        raise ValueError("successor tables are built for trigram models")
    k = min(k, base - 1)  # every token id and </s> can follow; <s> cannot
    uni_tok, uni_prob = _top(model.unigram[None, :], k)
    width = min(k + EXTRA_CANDIDATES, base)
    big_tok, big_prob = np.empty((base, width), np.int64), np.empty((base, width))
    for lo in range(0, base, ROW_CHUNK):
        rows = _bigram_rows(model, np.arange(lo, min(lo + ROW_CHUNK, base)))
        big_tok[lo : lo + ROW_CHUNK], big_prob[lo : lo + ROW_CHUNK] = _top(rows, width)

    # Trigram histories: seen continuations, plus backed-off candidates from the bigram row of v.
    level = model.levels[1]
    hist_of = level.keys // base
    starts = np.flatnonzero(np.concatenate([[True], hist_of[1:] != hist_of[:-1]]))
    seen_tok, seen_prob = _grouped_top(level.keys % base, level.prob, starts, k)
    alpha = level.alpha  # level.histories == hist_of[starts]
    v = level.histories % base
    cand_tok = big_tok[v]
    in_seen = np.isin(level.histories[:, None] * base + cand_tok, level.keys)  # seen words are ranked already
    cand_prob = np.where(in_seen, -1.0, alpha[:, None] * big_prob[v])
    tri_tok, tri_prob = _top(np.concatenate([seen_prob, cand_prob], 1), k)
    tri_tok = np.take_along_axis(np.concatenate([seen_tok, cand_tok], 1), tri_tok, 1)
    # Rows whose candidate list ran out of unseen words (more than EXTRA_CANDIDATES seen among them): exact.
    for r in np.flatnonzero((~in_seen).sum(1) < k):
        full = alpha[r] * _bigram_rows(model, v[r : r + 1])[0]
        a, b = starts[r], (starts[r + 1] if r + 1 < starts.size else level.keys.size)
        full[level.keys[a:b] % base] = level.prob[a:b]
        t, p = _top(full[None, :], k)
        tri_tok[r], tri_prob[r] = t[0], p[0]

    def tokens(symbols):  # </s> is the tokenizer's end-of-text token
        return np.where(symbols == vocab.eos, eos_id, symbols).astype(np.int32)

    return SuccessorTable(
        vocab_size=vocab.size, eos_id=eos_id,
        unigram_tokens=tokens(uni_tok[0]), unigram_probs=uni_prob[0].astype(np.float32),
        bigram_tokens=tokens(big_tok[:, :k]), bigram_probs=big_prob[:, :k].astype(np.float32),
        trigram_histories=level.histories, trigram_tokens=tokens(tri_tok), trigram_probs=tri_prob.astype(np.float32),
    )
