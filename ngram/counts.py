"""N-gram counts over token-id documents, vectorised with numpy.

Symbols: token ids 0..V-1, then BOS = V (`<s>`) and EOS = V + 1 (`</s>`). Each document is counted
as `<s> w1 ... wn </s>`; an n-gram never crosses a document boundary. An n-gram is one int64 key in
base V + 2 (history first), so counting is a sort: no per-token Python on the hot path.
"""
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
from tqdm.auto import tqdm

CHUNK_TOKENS = 4_000_000


@dataclass(frozen=True)
class Vocabulary:
    size: int  # token ids 0 .. size - 1

    @property
    def bos(self) -> int:
        return self.size

    @property
    def eos(self) -> int:
        return self.size + 1

    @property
    def base(self) -> int:
        return self.size + 2


@dataclass
class NgramCounts:
    """Sorted unique keys and their counts, per order (index 0 holds unigrams)."""

    vocab: Vocabulary
    keys: list[np.ndarray]
    counts: list[np.ndarray]

    @property
    def order(self) -> int:
        return len(self.keys)


def stream(documents: list[np.ndarray], vocab: Vocabulary) -> np.ndarray:
    """Concatenate documents as <s> w1 .. wn </s> <s> ... (int64)."""
    lengths = np.array([len(d) for d in documents], dtype=np.int64)
    out = np.empty(int(lengths.sum()) + 2 * len(documents), dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths + 2)[:-1]])
    out[starts] = vocab.bos
    out[starts + lengths + 1] = vocab.eos
    body = np.ones(out.size, dtype=bool)
    body[starts] = body[starts + lengths + 1] = False
    out[body] = np.concatenate(documents) if documents else np.empty(0, np.int64)
    return out


def ngram_keys(symbols: np.ndarray, n: int, vocab: Vocabulary) -> np.ndarray:
    """Keys of every n-gram inside a document: no </s> in the history, no <s> predicted."""
    m = symbols.size - n + 1
    if m <= 0:
        return np.empty(0, np.int64)
    keys = np.zeros(m, dtype=np.int64)
    valid = symbols[n - 1 :] != vocab.bos
    for j in range(n):
        part = symbols[j : j + m]
        keys = keys * vocab.base + part
        if j < n - 1:
            valid &= part != vocab.eos
    return keys[valid]


def _merge(keys: list[np.ndarray], counts: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    allkeys, allcounts = np.concatenate(keys), np.concatenate(counts)
    order = np.argsort(allkeys, kind="stable")
    allkeys, allcounts = allkeys[order], allcounts[order]
    starts = np.flatnonzero(np.concatenate([[True], allkeys[1:] != allkeys[:-1]]))
    return allkeys[starts], np.add.reduceat(allcounts, starts) if allkeys.size else allcounts


def count(documents: Iterable[np.ndarray], vocab: Vocabulary, order: int = 3, total_tokens: int | None = None) -> NgramCounts:
    """Count n-grams of orders 1..order over documents of token ids, in chunks of about CHUNK_TOKENS."""
    partial: list[tuple[list, list]] = [([], []) for _ in range(order)]

    def flush(batch):
        symbols = stream(batch, vocab)
        for n in range(1, order + 1):
            keys, counts = np.unique(ngram_keys(symbols, n, vocab), return_counts=True)
            partial[n - 1][0].append(keys)
            partial[n - 1][1].append(counts.astype(np.int64))

    batch, size = [], 0
    with tqdm(total=total_tokens, desc="counting n-grams", unit="tok", unit_scale=True) as bar:
        for doc in documents:
            batch.append(np.asarray(doc, dtype=np.int64))
            size += len(doc)
            if size >= CHUNK_TOKENS:
                flush(batch)
                bar.update(size)
                batch, size = [], 0
        if batch:
            flush(batch)
            bar.update(size)
    merged = [_merge(k, c) if k else (np.empty(0, np.int64), np.empty(0, np.int64)) for k, c in partial]
    return NgramCounts(vocab, [m[0] for m in merged], [m[1] for m in merged])
