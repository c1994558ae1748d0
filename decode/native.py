"""A decoding step's loops over trees in C++ (decode/native_step.cpp): the trigram's tree below a new context, the
staged drafter's greedy selection of the oracle's tree from the draft's logits, sample-match verification under
greedy decoding, each row's argmax token, and the continuations a context repeats (prompt lookup). Right after a forward, each of the tens of torch, numpy and list
operations these take in Python pays for caches the forward evicted; one call pays once (README section 4, "A step's
loops in C++").

torch's extension builder compiles the file on first use (a few seconds; cached under ~/.cache/torch_extensions in a
directory named by the source's hash, so checkouts of different versions neither rebuild in turn nor replace a
module another process has loaded). Where it cannot (no C++ compiler or ninja), or the data are not laid out as the
loops read them (logits not float32 rows in CPU memory), decoding takes the Python code, which gives the same trees
and paths. STAGED_SPECULATIVE_NATIVE=0 turns the C++ off.
"""
import functools
import hashlib
import os
import sys
from pathlib import Path

import numpy as np
import torch

from data.errors import first_line

SOURCE = Path(__file__).with_name("native_step.cpp")


@functools.lru_cache(maxsize=None)
def module():
    """The compiled module, or None (said once on stderr, with why) where it cannot be built."""
    if os.environ.get("STAGED_SPECULATIVE_NATIVE", "1") == "0":
        return None
    try:
        from torch.utils import cpp_extension

        name = f"native_step_{hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:12]}"
        return cpp_extension.load(name, [str(SOURCE)], extra_cflags=["-O3", "-fopenmp-simd"])
    except Exception as err:  # no compiler, no ninja, a failed build: decoding goes on in Python
        print(f"note: the decoding step's C++ loops could not be built ({first_line(err)}); decoding uses their Python "
              f"code, which gives the same output a little slower (STAGED_SPECULATIVE_NATIVE=0 silences this)",
              file=sys.stderr)
        return None


def loops(device: str) -> str:
    """Where a step's loops run, as the benchmark and the step profile say it."""
    if module() is None:
        return "Python"
    return "C++" if torch.device(device).type == "cpu" else "C++ for the trees, Python for the GPU's logits"


def takes(logits: torch.Tensor) -> bool:
    """Whether the C++ loops can read these logits: float32 rows, contiguous, in CPU memory."""
    return (logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.is_contiguous()
            and module() is not None)


def trigram_source(table) -> tuple | None:
    """What `trigram_tree` reads of a successor table (ngram/successors.py), or None where the C++ loops cannot
    read it. The caller keeps the table: the loops read its arrays in place."""
    histories, successors = table.histories, table.successors
    if (module() is None or histories.dtype != np.int64 or successors.dtype.itemsize != 12
            or not histories.flags.c_contiguous or not successors.flags.c_contiguous):
        return None
    return (histories.__array_interface__["data"][0], histories.size, successors.__array_interface__["data"][0],
            successors.shape[1], table.vocab_size)


def trigram_tree(source: tuple, before_root: int, root: int, widths: list[int]) -> tuple[list[int], list[float]]:
    """TrigramTrees.build's tokens and probabilities, from a `trigram_source`."""
    return module().trigram_tree(*source, before_root, root, widths)


def staged_selection(logits: torch.Tensor, order: list[int], parents: list[int], tokens: list[int], depths: list[int],
                     copied, shortlist, max_depth: int, budget: int) -> tuple[list[int], list[int], list[int]]:
    """StagedDrafter.selection's tree as (tokens, parents) and its `kept` (greedy, one draft child per node)."""
    columns = (None, None) if shortlist is None else (shortlist.tokens, shortlist.column)
    return module().staged_selection(logits.data_ptr(), logits.shape[0], logits.shape[1], order, parents, tokens,
                                     depths, list(copied), *columns, max_depth, budget)


def greedy_walk(logits: torch.Tensor, tokens: list[int], parents: list[int]) -> tuple[list[int], int]:
    """sample_match's path and following token under greedy decoding."""
    return module().greedy_walk(logits.data_ptr(), logits.shape[0], logits.shape[1], tokens, parents)


def best_tokens(logits: torch.Tensor, shortlist) -> list[int]:
    """sampling.row_argmax: each row's argmax token."""
    return module().best_tokens(logits.data_ptr(), logits.shape[0], logits.shape[1],
                                None if shortlist is None else shortlist.tokens)


def continuations(tokens: list[int], max_ngram: int, length: int, branches: int) -> list[list[int]]:
    """ContextIndex.continuations, from a scan of the sequence instead of an index."""
    return module().continuations(tokens, max_ngram, length, branches)
