"""Token shards: one flat array of token ids per split (documents separated by end-of-text), as a
numpy memmap, plus meta.json describing them.
"""
import json
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from decode.atomic import write_json
from decode.errors import InputError

META = "meta.json"


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned integer type that holds every id."""
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


def write_tokens(path: Path, documents: Iterable[list[int]], eos_id: int, dtype: np.dtype) -> int:
    """Write each document's ids followed by `eos_id`; returns the number of tokens written."""
    count = 0
    with open(path, "wb") as f:
        for ids in documents:
            arr = np.asarray(ids + [eos_id], dtype=dtype)
            f.write(arr.tobytes())
            count += arr.size
    return count


def write_meta(directory: Path, meta: dict) -> None:
    write_json(directory / META, meta)


# What every reader of meta.json needs, with its type
META_FIELDS = {"vocab_size": int, "eos_id": int, "dtype": str, "splits": dict, "tokenizer": str}


def read_meta(data_dir) -> dict:
    """meta.json of a prepared data directory, with a one-line error when it is missing or damaged (not JSON, or a
    field of META_FIELDS missing or of another type)."""
    path = Path(data_dir) / META
    if not path.is_file():
        raise InputError(f"{data_dir} holds no prepared data ({META} missing); run `python -m data.prepare --out RUN` first")
    again = f"prepare the data again (`python -m data.prepare --out {Path(data_dir).parent} --overwrite`)"
    try:
        meta = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise InputError(f"{path} is damaged ({type(err).__name__}: {err}); {again}") from None
    if not isinstance(meta, dict):
        raise InputError(f"{path} is damaged (not a JSON object); {again}")
    bad = [f"{name} ({kind.__name__})" for name, kind in META_FIELDS.items() if not isinstance(meta.get(name), kind)]
    if bad:
        raise InputError(f"{path} lacks {', '.join(bad)} or holds another type there; {again}")
    return meta


def open_split(data_dir, split: str) -> np.memmap:
    """The token ids of one split ('train' or 'val'), memory-mapped read-only."""
    meta = read_meta(data_dir)
    path = Path(data_dir) / f"{split}.bin"
    if split not in meta["splits"] or not path.is_file():
        raise InputError(f"{data_dir} has no {split} split ({path.name} missing); re-run `python -m data.prepare`")
    return np.memmap(path, dtype=np.dtype(meta["dtype"]), mode="r")


def split_documents(tokens: np.ndarray, eos_id: int) -> list[np.ndarray]:
    """Cut a flat token array back into its documents (the end-of-text separators removed)."""
    ends = np.flatnonzero(tokens == eos_id)
    starts = np.concatenate([[0], ends[:-1] + 1])
    return [tokens[s:e] for s, e in zip(starts, ends)]


def token_counts(data_dir, split: str = "train") -> np.ndarray:
    """How often each token id occurs in a split: (vocab_size,) int64."""
    return np.bincount(open_split(data_dir, split), minlength=read_meta(data_dir)["vocab_size"]).astype(np.int64)
