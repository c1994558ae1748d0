"""The loops a decoding step runs over logits and trees, as one interface with one implementation per place: the
C++ loops (`NativeKernels`) where a model's logits are in CPU memory and the loops are built, the portable ones
(`PortableKernels`: torch, numpy and Python, on any device) elsewhere. A model's runtime (decode.models.runtime) chooses
once, when the model is built; every rule lives in one of the two and nowhere else, and the tests compare them.

    top_tokens(logits, k, shortlist)                     each row's k best tokens, best first
    distributions(logits, rows, sampling, shortlist)     a top-k setting's processed distributions of rows, as Sparse
    draws(logits, rows, count, sampling, shortlist, u)   `count` draws from each such distribution, at uniforms u
    sample_match(tree, target, generator)                greedy or sampled sample-match verification (decode.verify)
    multi_draft_rejection(tree, target, generator)       multi-draft rejection verification (decode.verify)
    staged_selection(tree, logits, order, copied, ...)   the staged drafter's tree for the oracle (decode.ranking)
    continuations(tokens, max_ngram, length, branches)   what the context repeats after its latest suffix
    trigram_reader(table)                                the trigram's tree below a context, from a successor table
"""
from abc import ABC, abstractmethod
from collections.abc import Callable

import torch

from decode.sampling import Sampling, Sparse, Uniforms, draw
from decode.shortlist import Shortlist
from decode.tree import Tree

TrigramReader = Callable[[int, int, list[int]], tuple[list[int], list[float]]]  # (before_root, root, widths) -> tree


class StepKernels(ABC):
    name: str  # where the loops run, as reports say it

    @abstractmethod
    def top_tokens(self, logits: torch.Tensor, k: int, shortlist: Shortlist | None = None) -> list[list[int]]:
        """Each row's `k` best tokens, best first (ties: the lower column first); with a shortlist, the logits'
        columns are its tokens."""

    @abstractmethod
    def distributions(self, logits: torch.Tensor, rows: list[int], sampling: Sampling,
                      shortlist: Shortlist | None = None) -> list[Sparse]:
        """The processed distribution after each of `rows` (a top-k setting: `sampling.sparse`), likeliest first."""

    @abstractmethod
    def draws(self, logits: torch.Tensor, rows: list[int], count: int, sampling: Sampling, shortlist: Shortlist | None,
              uniforms: list[float]) -> tuple[list[list[int]], list[Sparse]]:
        """`count` draws from each of those distributions, row i's at uniforms[i * count:(i + 1) * count] (each
        `Sparse.draw`), and the distributions."""

    @abstractmethod
    def sample_match(self, tree: Tree, target, generator: Uniforms) -> tuple[list[int], int]:
        """decode.verify.sample_match: the accepted nodes (the root first) and the token that follows."""

    @abstractmethod
    def multi_draft_rejection(self, tree: Tree, target, generator: Uniforms) -> tuple[list[int], int]:
        """decode.verify.multi_draft_rejection, taking the same draws from `generator`."""

    @abstractmethod
    def staged_selection(self, tree: Tree, logits: torch.Tensor, order: list[int], copied: set[int], max_depth: int,
                         budget: int, children: int, sampling: Sampling,
                         shortlist: Shortlist | None = None) -> tuple[Tree, list[int]]:
        """decode.ranking.staged_selection: the oracle's tree and, for each of its nodes, the candidate it came from."""

    @abstractmethod
    def continuations(self, tokens: list[int], max_ngram: int, length: int, branches: int = 1) -> list[list[int]]:
        """Up to `branches` different continuations of `length` tokens that followed the longest suffix of `tokens`
        (at most `max_ngram` of them) seen before, the latest occurrence first. A continuation that runs into the end
        of the sequence goes on with its own tokens: the text repeats with the period it just showed."""

    @abstractmethod
    def trigram_reader(self, table) -> TrigramReader:
        """A function of (the token before the root, the root, the widths per level) that gives the tokens and
        probabilities of the trigram's tree below that context, level by level, each parent's children by rank:
        one search for the root's row of the successor table (decode/models/successors.py), then a gather a level (each
        successor names the row after it). Made once per table, which the caller keeps."""

    def row_argmax(self, logits: torch.Tensor, shortlist: Shortlist | None = None) -> list[int]:
        """The argmax token of each row (`top_tokens` with k = 1)."""
        return [best for best, in self.top_tokens(logits, 1, shortlist)]

    def choose(self, logits: torch.Tensor, sampling: Sampling, generator: Uniforms) -> int:
        """One token from the processed distribution of one row of logits (the argmax when greedy), drawn as the
        verification rules draw from the oracle's p (`draw`): with one seed, a tree that does not depend on the draws
        gives these tokens."""
        if sampling.greedy:
            return self.row_argmax(logits[None])[0]
        return draw(self.distributions(logits[None], [0], sampling)[0] if sampling.sparse else sampling.probs(logits),
                    generator)
