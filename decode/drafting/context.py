"""Drafts from the context itself: the tokens that followed the latest earlier occurrences of the
sequence's current suffix (prompt-lookup decoding; llama.cpp's lookup modes). Code repeats its
identifiers, its signature and the words of its docstring, so what the context already holds is
the cheapest good draft.
"""
from decode import native
from decode.drafting.base import ModelFreeDrafter
from decode.sampling import Sampling
from decode.tree import Tree


class ContextIndex:
    """Where each n-gram (n = 1..max_ngram) of a growing sequence occurred, built incrementally: one
    dictionary update per new token and order, one lookup per order when drafting."""

    def __init__(self, max_ngram: int = 3):
        self.max_ngram = max_ngram
        self.scan = native.module() is not None  # the step's C++ loops scan the sequence instead of an index
        self.reset()

    def reset(self) -> None:
        self.ends = {}  # n-gram -> the positions right after its occurrences, in order
        self.indexed = 1  # occurrences ending before this position are indexed

    def update(self, tokens: list[int]) -> None:
        """Index the occurrences that a token follows (`tokens` only ever grows between resets)."""
        for end in range(self.indexed, len(tokens)):
            for n in range(1, min(self.max_ngram, end) + 1):
                self.ends.setdefault(tuple(tokens[end - n : end]), []).append(end)
        self.indexed = max(self.indexed, len(tokens))

    def continuations(self, tokens: list[int], length: int, branches: int = 1) -> list[list[int]]:
        """Up to `branches` different continuations of `length` tokens that followed the longest suffix
        of `tokens` seen before, the latest occurrence first. A continuation that runs into the end of
        the sequence goes on with its own tokens: the text repeats with the period it just showed. With the step's
        C++ loops, a scan of the sequence finds the same (decode/native/step.cpp; updating the index in Python cost
        more than the scan)."""
        if self.scan:
            return native.continuations(tokens, self.max_ngram, length, branches)
        self.update(tokens)
        for n in range(min(self.max_ngram, len(tokens) - 1), 0, -1):
            chains = []
            for end in reversed(self.ends.get(tuple(tokens[-n:]), ())):
                chain = tokens[end : end + length]
                while len(chain) < length:  # `end` lies within `length` of the end: repeat the period
                    chain.append(chain[len(chain) - (len(tokens) - end)])
                if chain not in chains:
                    chains.append(chain)
                    if len(chains) == branches:
                        break
            if chains:
                return chains
        return []


class LookupDrafter(ModelFreeDrafter):
    """The context alone: up to `branches` continuations of `length` tokens that followed the latest
    earlier occurrences of the longest suffix (of at most `max_ngram` tokens) seen before."""

    def __init__(self, length: int = 10, branches: int = 1, max_ngram: int = 3):
        self.length, self.branches, self.index = length, branches, ContextIndex(max_ngram)

    def describe(self) -> dict:
        return {"tokens": self.length, "branches": self.branches, "ngram": self.index.max_ngram}

    def reset(self) -> None:
        self.index.reset()

    def graft(self, tree: Tree, tokens: list[int], max_depth: int) -> set[int]:
        """Add the continuations below the root of `tree` (which stands for tokens[-1]); returns their nodes."""
        nodes = set()
        for chain in self.index.continuations(tokens, min(self.length, max_depth), self.branches):
            nodes.update(tree.add_path(chain))
        return nodes

    def propose(self, tokens: list[int], max_depth: int, sampling: Sampling, generator) -> Tree:
        tree = Tree.rooted(tokens[-1])
        self.graft(tree, tokens, max_depth)
        return tree
