"""Drafts from the context itself: the tokens that followed the latest earlier occurrences of the
sequence's current suffix (prompt-lookup decoding; llama.cpp's lookup modes). Code repeats its
identifiers, its signature and the words of its docstring, so what the context already holds is
the cheapest good draft.
"""
from decode.drafting.base import ModelFreeDrafter
from decode.models.runtime import host_kernels
from decode.sampling import Sampling
from decode.tree import Tree


class LookupDrafter(ModelFreeDrafter):
    """The context alone: up to `branches` continuations of `length` tokens that followed the latest
    earlier occurrences of the longest suffix (of at most `max_ngram` tokens) seen before
    (StepKernels.continuations: a scan of the sequence)."""

    def __init__(self, length: int = 10, branches: int = 1, max_ngram: int = 3):
        self.length, self.branches, self.max_ngram = length, branches, max_ngram
        self.kernels = host_kernels()

    def describe(self) -> dict:
        return {"tokens": self.length, "branches": self.branches, "ngram": self.max_ngram}

    def graft(self, tree: Tree, tokens: list[int], max_depth: int) -> set[int]:
        """Add the continuations below the root of `tree` (which stands for tokens[-1]); returns their nodes."""
        nodes = set()
        for chain in self.kernels.continuations(tokens, self.max_ngram, min(self.length, max_depth), self.branches):
            nodes.update(tree.add_path(chain))
        return nodes

    def propose(self, tokens: list[int], max_depth: int, sampling: Sampling, generator) -> Tree:
        tree = Tree.rooted(tokens[-1])
        self.graft(tree, tokens, max_depth)
        return tree
