"""Write a Katz model as an ARPA file (log10 probabilities and backoff weights), the format kenlm,
SRILM and most n-gram tools read. Words are token ids as decimal strings plus <s>, </s>, <unk>."""
import numpy as np

from decode.atomic import atomic_output
from ngram.katz import LOG10_ZERO, KatzModel


def symbol_names(model: KatzModel) -> np.ndarray:
    return np.array([str(i) for i in range(model.vocab.size)] + ["<s>", "</s>"], dtype=object)


def _log10(x: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore"):
        return np.where(x > 0, np.log10(np.maximum(x, 1e-300)), LOG10_ZERO)


def _lines(logp: np.ndarray, words: list[str], backoff: np.ndarray | None) -> str:
    if backoff is None:
        return "".join(f"{p:.7f}\t{w}\n" for p, w in zip(logp.tolist(), words))
    return "".join(
        f"{p:.7f}\t{w}\t{b:.7f}\n" if b == b else f"{p:.7f}\t{w}\n"  # NaN: not a history, no backoff weight
        for p, w, b in zip(logp.tolist(), words, backoff.tolist())
    )


def _backoffs(model: KatzModel, keys: np.ndarray, n: int) -> np.ndarray | None:
    """log10 alpha of each n-gram that is a history of order n + 1 (NaN for the others)."""
    if n >= model.order:
        return None
    level = model.levels[n - 1]
    idx = np.searchsorted(level.histories, keys).clip(max=max(level.histories.size - 1, 0))
    found = level.histories[idx] == keys if level.histories.size else np.zeros(keys.shape, bool)
    return np.where(found, _log10(level.alpha[idx]), np.nan)


def write_arpa(model: KatzModel, path) -> None:
    names = symbol_names(model)
    base = model.vocab.base
    unigram_keys = np.array([s for s in range(base)], dtype=np.int64)
    unigram_logp = _log10(model.unigram)
    unigram_logp[model.vocab.bos] = LOG10_ZERO
    with atomic_output(path) as tmp, open(tmp, "w") as f:
        sizes = [base + 1] + [level.keys.size for level in model.levels]
        f.write("\\data\\\n" + "".join(f"ngram {n}={size}\n" for n, size in enumerate(sizes, 1)))
        f.write("\n\\1-grams:\n")
        f.write(f"{LOG10_ZERO:.7f}\t<unk>\n")
        f.write(_lines(unigram_logp, list(names), _backoffs(model, unigram_keys, 1)))
        for n, level in enumerate(model.levels, 2):
            digits = [names[(level.keys // base ** (n - 1 - t)) % base] for t in range(n)]
            words = [" ".join(ws) for ws in zip(*digits)]
            f.write(f"\n\\{n}-grams:\n")
            f.write(_lines(_log10(level.prob), words, _backoffs(model, level.keys, n)))
        f.write("\n\\end\\\n")
