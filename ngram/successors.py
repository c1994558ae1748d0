"""Building top-K successor tables (`decode.models.successors`) from a Katz model: for every seen trigram
history and every history symbol, the K most probable next tokens under the full model."""
import numpy as np

from decode.models.successors import SUCCESSOR, SuccessorTable
from ngram.katz import KatzModel

ROW_CHUNK = 512  # histories per dense block when ranking a whole row
EXTRA_CANDIDATES = 48  # lower-order candidates kept beyond K; rows with more seen overlap fall back to exact


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

    successors = np.empty((level.histories.size + base, k), SUCCESSOR)
    tokens = np.concatenate([tri_tok, big_tok[:, :k]])
    successors["token"] = np.where(tokens == vocab.eos, eos_id, tokens)  # </s> is the tokenizer's end-of-text token
    successors["prob"] = np.concatenate([tri_prob, big_prob[:, :k]])
    table = SuccessorTable(vocab_size=vocab.size, eos_id=eos_id, histories=level.histories, successors=successors)
    # Each row's last history symbol, then each token's row after it: as the drafters look contexts up.
    after = np.concatenate([level.histories % base, np.arange(base)])
    successors["next"] = table.rows_after(after[:, None], successors["token"])
    return table
