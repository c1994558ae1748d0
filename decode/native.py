"""A greedy step's loops over a tree in C++ (decode/greedy_step.cpp): the staged drafter's selection of the
oracle's tree from the draft's logits, and sample-match verification. Right after a forward, each of the
fifty-odd torch, numpy and list operations these take in Python pays for caches the forward evicted; one call
pays once (on the cpu preset, a staged step's time around the forwards fell by a fifth: README section 5).

torch's extension builder compiles the file on first use (a second or two; cached per source under
~/.cache/torch_extensions). Where it cannot (no C++ compiler or ninja), or the logits are not float32 rows in CPU
memory, decoding takes the Python code, which gives the same trees and paths. STAGED_SPECULATIVE_NATIVE=0 turns
the C++ off.
"""
import functools
import os
import sys
from pathlib import Path

import torch

from data.errors import first_line

SOURCE = Path(__file__).with_name("greedy_step.cpp")


@functools.lru_cache(maxsize=None)
def module():
    """The compiled module, or None (said once on stderr, with why) where it cannot be built."""
    if os.environ.get("STAGED_SPECULATIVE_NATIVE", "1") == "0":
        return None
    try:
        from torch.utils import cpp_extension

        return cpp_extension.load("greedy_step", [str(SOURCE)], extra_cflags=["-O3", "-fopenmp-simd"])
    except Exception as err:  # no compiler, no ninja, a failed build: decoding goes on in Python
        print(f"note: the greedy step's C++ loops could not be built ({first_line(err)}); decoding uses their Python "
              f"code, which gives the same output a little slower (STAGED_SPECULATIVE_NATIVE=0 silences this)",
              file=sys.stderr)
        return None


def takes(logits: torch.Tensor) -> bool:
    """Whether the C++ loops can read these logits: float32 rows, contiguous, in CPU memory."""
    return (logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.is_contiguous()
            and module() is not None)


def staged_selection(logits: torch.Tensor, order: list[int], parents: list[int], tokens: list[int], depths: list[int],
                     copied, shortlist, max_depth: int, budget: int) -> tuple[list[int], list[int], list[int]]:
    """StagedDrafter.selection's tree as (tokens, parents) and its `kept` (greedy, one draft child per node)."""
    return module().staged_selection(logits.data_ptr(), logits.shape[0], logits.shape[1], order, parents, tokens, depths,
                                     list(copied), None if shortlist is None else shortlist.tokens,
                                     None if shortlist is None else shortlist.column, max_depth, budget)


def greedy_walk(logits: torch.Tensor, tokens: list[int], parents: list[int]) -> tuple[list[int], int]:
    """sample_match's path and following token under greedy decoding."""
    return module().greedy_walk(logits.data_ptr(), logits.shape[0], logits.shape[1], tokens, parents)
