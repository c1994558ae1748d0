"""Top-K successor tables: the draft-of-the-draft's fast path.

For every seen trigram history (u, v) and every history symbol v (Katz's backoff), a row of the K most
probable next tokens under the full Katz model with their probabilities, and for each token the row
that follows it: a tree below a context is one search for its first row and then a gather a level.
A batch of contexts is one searchsorted and a gather. `</s>` is returned as the tokenizer's end-of-text id.
"""
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from decode.atomic import atomic_output
from decode.errors import InputError, first_line

# One successor: a token, its probability, and the row of the table that follows it. Side by side, a
# row's first tokens lie in one or two cache lines: a new context's tree reads a few dozen rows of a
# table of tens of megabytes, and each row read is a cache miss.
SUCCESSOR = np.dtype([("token", np.int32), ("prob", np.float32), ("next", np.int32)])


@dataclass
class SuccessorTable:
    vocab_size: int
    eos_id: int
    histories: np.ndarray  # (H,) sorted trigram history keys u * (V + 2) + v
    # (H + V + 2, K) SUCCESSOR, each row most probable first: row r < H follows the history histories[r],
    # row H + v follows v alone (the bigram level; an unseen v: the unigram level's row). `next` is the
    # row after (v, token): its history's row when seen, else the token's own.
    successors: np.ndarray

    @property
    def bos(self) -> int:
        return self.vocab_size

    @property
    def k(self) -> int:
        return self.successors.shape[1]

    def rows_after(self, u, v) -> np.ndarray:
        """The row that follows each context (u, v): the trigram's when the history was seen, else v's
        backoff row. u may be `bos` (start of text)."""
        keys = np.asarray(u, np.int64) * (self.vocab_size + 2) + v
        idx = np.minimum(self.histories.searchsorted(keys), self.histories.size - 1)
        return np.where(self.histories[idx] == keys, idx, self.histories.size + np.asarray(v))

    def lookup(self, u: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Top-K next tokens and probabilities after each context (u, v); u may be `bos` (start of text)."""
        found = self.successors[self.rows_after(u, v)]
        return found["token"], found["prob"]

    @classmethod
    def field_names(cls) -> list[str]:
        """The arrays a table is saved as."""
        return [f.name for f in dataclasses.fields(cls) if f.init]

    def save(self, path) -> None:
        with atomic_output(path) as tmp:
            with open(tmp, "wb") as f:
                arrays: dict[str, Any] = {name: np.asarray(getattr(self, name)) for name in self.field_names()}
                np.savez(f, **arrays)

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
            raise InputError(f"{path} is not a successor table of this version (fields {sorted(fields)}); rebuild it with "
                             f"`python ngram/build_katz.py --out {path.parent} --overwrite`")
        values: dict[str, Any] = {k: (int(v) if v.ndim == 0 else v) for k, v in fields.items()}
        return cls(**values)
