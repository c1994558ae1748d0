"""The step's loops as single C++ calls (decode/native/step.cpp) over logits in CPU memory. Right after a forward,
each of the tens of torch, numpy and list operations a loop takes in Python pays for caches the forward evicted; one
call pays once. Every argument is passed by name, and the C++ checks what it is handed (float32 rows in one block,
int64 shortlists, the successor table's records) before it reads it. Settings the C++ loops do not cover (sampling
without a top-k, several draft children a node in the staged selection) run the portable code."""
import torch

from decode import native
from decode.kernels.base import TrigramReader
from decode.kernels.portable import PortableKernels
from decode.sampling import Sampling, Sparse
from decode.shortlist import Shortlist
from decode.tree import Tree


def logit_array(logits: torch.Tensor):
    """Logits as the C++ reads them: a numpy array over the tensor's memory (which the C++ checks is float32 rows,
    in one block)."""
    try:
        return logits.numpy()
    except (TypeError, RuntimeError):  # a dtype numpy lacks (bfloat16), or memory numpy cannot see (a GPU's)
        raise TypeError(f"logits must be contiguous float32 rows in CPU memory, not a {logits.dtype} tensor on "
                        f"{logits.device}") from None


def shortlist_tokens(shortlist: Shortlist | None):
    return None if shortlist is None else shortlist.tokens


def sparse_setting(logits: torch.Tensor, sampling: Sampling, shortlist: Shortlist | None) -> dict:
    """The arguments of the loops that read top-k distributions off logits (step.cpp's SparseRows)."""
    return {"logits": logit_array(logits), "top_k": sampling.top_k, "temperature": float(sampling.temperature),
            "top_p": float(sampling.top_p), "shortlist_tokens": shortlist_tokens(shortlist)}


class NativeTrigramReader:
    """StepKernels.trigram_reader in C++: it holds the successor table whose arrays each call reads in place."""

    def __init__(self, module, table):
        self.trigram_tree, self.table = module.trigram_tree, table

    def __call__(self, before_root: int, root: int, widths: list[int]) -> tuple[list[int], list[float]]:
        table = self.table
        return self.trigram_tree(histories=table.histories, successors=table.successors, vocab_size=table.vocab_size,
                                 before_root=before_root, root=root, widths=widths)


class NativeKernels(PortableKernels):
    name = "C++"

    def __init__(self, module=None):
        """`module`: the compiled step.cpp (default: decode/native's)."""
        self.module = module or native.module()

    def top_tokens(self, logits: torch.Tensor, k: int, shortlist: Shortlist | None = None) -> list[list[int]]:
        return self.module.top_tokens(logits=logit_array(logits), k=k, shortlist_tokens=shortlist_tokens(shortlist))

    def distributions(self, logits: torch.Tensor, rows: list[int], sampling: Sampling,
                      shortlist: Shortlist | None = None) -> list[Sparse]:
        return self.module.draws(**sparse_setting(logits, sampling, shortlist), rows=rows, count=0, uniforms=[])[1]

    def draws(self, logits: torch.Tensor, rows: list[int], count: int, sampling: Sampling, shortlist: Shortlist | None,
              uniforms: list[float]) -> tuple[list[list[int]], list[Sparse]]:
        return self.module.draws(**sparse_setting(logits, sampling, shortlist), rows=rows, count=count,
                                 uniforms=uniforms)

    def sample_match(self, tree: Tree, target, generator) -> tuple[list[int], int]:
        if not target.sampling.greedy:
            return super().sample_match(tree, target, generator)
        return self.module.greedy_walk(logits=logit_array(target.logits), tokens=tree.tokens, parents=tree.parents)

    def multi_draft_rejection(self, tree: Tree, target, generator) -> tuple[list[int], int]:
        if not target.sampling.sparse:
            return super().multi_draft_rejection(tree, target, generator)
        path, following, used = self.module.rejection_walk(
            **sparse_setting(target.logits, target.sampling, None), tokens=tree.tokens, parents=tree.parents,
            child_dists=tree.child_dists, uniforms=generator.peek(len(tree)))
        generator.skip(used)
        return path, following

    def staged_selection(self, tree: Tree, logits: torch.Tensor, order: list[int], copied: set[int], max_depth: int,
                         budget: int, children: int, sampling: Sampling,
                         shortlist: Shortlist | None = None) -> tuple[Tree, list[int]]:
        if not sampling.greedy or children != 1:
            return super().staged_selection(tree, logits, order, copied, max_depth, budget, children, sampling,
                                            shortlist)
        tokens, parents, kept = self.module.staged_selection(
            logits=logit_array(logits), order=order, parents=tree.parents, tokens=tree.tokens, depths=tree.depths,
            copied=list(copied), shortlist_tokens=shortlist_tokens(shortlist),
            shortlist_columns=None if shortlist is None else shortlist.column, max_depth=max_depth, budget=budget)
        return Tree.of(tokens, parents), kept

    def continuations(self, tokens: list[int], max_ngram: int, length: int, branches: int = 1) -> list[list[int]]:
        return self.module.continuations(tokens=tokens, max_ngram=max_ngram, length=length, branches=branches)

    def trigram_reader(self, table) -> TrigramReader:
        return NativeTrigramReader(self.module, table)
