"""The step's loops as single C++ calls (decode/native/step.cpp) over logits in CPU memory. Right after a forward,
each of the tens of torch, numpy and list operations a loop takes in Python pays for caches the forward evicted; one
call pays once. Each call checks what it is handed (float32 rows in CPU memory, in one block) before the C++ reads it.
Settings the C++ loops do not cover (sampling without a top-k, several draft children a node in the staged
selection) run the portable code."""
import functools

import numpy as np
import torch

from decode import native
from decode.kernels.portable import PortableKernels
from decode.kernels.base import TrigramReader
from decode.shortlist import Shortlist
from decode.sampling import Sampling, Sparse
from decode.tree import Tree


def logit_rows(logits: torch.Tensor) -> tuple[int, int, int]:
    """The (address, rows, columns) the C++ loops read: float32 rows, contiguous, in CPU memory."""
    if logits.dim() != 2 or not logits.is_cpu or logits.dtype != torch.float32 or not logits.is_contiguous():
        raise ValueError(f"the C++ loops read contiguous float32 rows in CPU memory, not a {logits.dtype} tensor of "
                         f"shape {tuple(logits.shape)} on {logits.device}")
    return logits.data_ptr(), logits.shape[0], logits.shape[1]


def shortlist_tokens(shortlist: Shortlist | None):
    return None if shortlist is None else shortlist.tokens


def sparse_setting(logits: torch.Tensor, sampling: Sampling, shortlist: Shortlist | None) -> tuple:
    """The leading arguments of the loops that read top-k distributions off logits (step.cpp's SparseRows)."""
    return (*logit_rows(logits), sampling.top_k, float(sampling.temperature), float(sampling.top_p),
            shortlist_tokens(shortlist))


class NativeKernels(PortableKernels):
    name = "C++"

    def __init__(self, module=None):
        """`module`: the compiled step.cpp (default: decode/native's)."""
        self.module = module or native.module()

    def top_tokens(self, logits: torch.Tensor, k: int, shortlist: Shortlist | None = None) -> list[list[int]]:
        return self.module.top_tokens(*logit_rows(logits), k, shortlist_tokens(shortlist))

    def distributions(self, logits: torch.Tensor, rows: list[int], sampling: Sampling,
                      shortlist: Shortlist | None = None) -> list[Sparse]:
        return self.module.draws(*sparse_setting(logits, sampling, shortlist), rows, Sparse, 0, [])[1]

    def draws(self, logits: torch.Tensor, rows: list[int], count: int, sampling: Sampling, shortlist: Shortlist | None,
              uniforms: list[float]) -> tuple[list[list[int]], list[Sparse]]:
        return self.module.draws(*sparse_setting(logits, sampling, shortlist), rows, Sparse, count, uniforms)

    def sample_match(self, tree: Tree, target, generator) -> tuple[list[int], int]:
        if not target.sampling.greedy:
            return super().sample_match(tree, target, generator)
        return self.module.greedy_walk(*logit_rows(target.logits), tree.tokens, tree.parents)

    def multi_draft_rejection(self, tree: Tree, target, generator) -> tuple[list[int], int]:
        if not target.sampling.sparse:
            return super().multi_draft_rejection(tree, target, generator)
        path, following, used = self.module.rejection_walk(*sparse_setting(target.logits, target.sampling, None),
                                                           tree.tokens, tree.parents, tree.child_dists,
                                                           generator.peek(len(tree)))
        generator.skip(used)
        return path, following

    def staged_selection(self, tree: Tree, logits: torch.Tensor, order: list[int], copied: set[int], max_depth: int,
                         budget: int, children: int, sampling: Sampling,
                         shortlist: Shortlist | None = None) -> tuple[Tree, list[int]]:
        if not sampling.greedy or children != 1:
            return super().staged_selection(tree, logits, order, copied, max_depth, budget, children, sampling,
                                            shortlist)
        columns = (None, None) if shortlist is None else (shortlist.tokens, shortlist.column)
        tokens, parents, kept = self.module.staged_selection(*logit_rows(logits), order, tree.parents, tree.tokens,
                                                             tree.depths, list(copied), *columns, max_depth, budget)
        return Tree.of(tokens, parents), kept

    def continuations(self, tokens: list[int], max_ngram: int, length: int, branches: int = 1) -> list[list[int]]:
        return self.module.continuations(tokens, max_ngram, length, branches)

    def trigram_reader(self, table) -> TrigramReader:
        histories, successors = table.histories, table.successors
        if (histories.dtype != np.int64 or successors.dtype.itemsize != 12 or not histories.flags.c_contiguous
                or not successors.flags.c_contiguous):
            raise ValueError("the C++ loops read a successor table as decode/models/successors.py lays it out: int64 histories "
                             "and 12-byte successors, each in one block")
        # the loops read the table's arrays in place: the caller keeps the table (TrigramTrees.table)
        source = (histories.__array_interface__["data"][0], histories.size, successors.__array_interface__["data"][0],
                  successors.shape[1], table.vocab_size)
        return functools.partial(self.module.trigram_tree, *source)
