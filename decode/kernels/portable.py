"""The step's loops in torch, numpy and Python: on any device, and the reference the C++ loops are tested against."""
import numpy as np
import torch

from decode import ranking, verify
from decode.kernels.base import StepKernels, TrigramReader
from decode.sampling import Sampling, Sparse, top_tokens
from decode.shortlist import Shortlist
from decode.tree import Tree


class PortableKernels(StepKernels):
    name = "Python"

    def top_tokens(self, logits: torch.Tensor, k: int, shortlist: Shortlist | None = None) -> list[list[int]]:
        return top_tokens(logits, k, shortlist).tolist()

    def distributions(self, logits: torch.Tensor, rows: list[int], sampling: Sampling,
                      shortlist: Shortlist | None = None) -> list[Sparse]:
        return sampling.distributions(logits, rows, shortlist)

    def draws(self, logits: torch.Tensor, rows: list[int], count: int, sampling: Sampling, shortlist: Shortlist | None,
              uniforms: list[float]) -> tuple[list[list[int]], list[Sparse]]:
        qs = self.distributions(logits, rows, sampling, shortlist)
        return [[q.draw(u) for u in uniforms[i * count : (i + 1) * count]] for i, q in enumerate(qs)], qs

    def sample_match(self, tree: Tree, target, generator) -> tuple[list[int], int]:
        return verify.sample_match(tree, target, generator)

    def multi_draft_rejection(self, tree: Tree, target, generator) -> tuple[list[int], int]:
        return verify.multi_draft_rejection(tree, target, generator)

    def staged_selection(self, tree: Tree, logits: torch.Tensor, order: list[int], copied: set[int], max_depth: int,
                         budget: int, children: int, sampling: Sampling,
                         shortlist: Shortlist | None = None) -> tuple[Tree, list[int]]:
        return ranking.staged_selection(tree, logits, order, copied, max_depth, budget, children, sampling, shortlist)

    def continuations(self, tokens: list[int], max_ngram: int, length: int, branches: int = 1) -> list[list[int]]:
        sequence, size = np.asarray(tokens), len(tokens)
        for n in range(min(max_ngram, size - 1), 0, -1):
            # the occurrences of the last n tokens that end before the last token, by where they end
            windows = np.lib.stride_tricks.sliding_window_view(sequence[: size - 1], n)
            ends = np.flatnonzero((windows == sequence[size - n :]).all(1)) + n
            chains = []
            for end in ends[::-1].tolist():
                chain = tokens[end : end + length]
                while len(chain) < length:  # `end` lies within `length` of the end: repeat the period
                    chain.append(chain[len(chain) - (size - end)])
                if chain not in chains:
                    chains.append(chain)
                    if len(chains) == branches:
                        break
            if chains:
                return chains
        return []

    def trigram_reader(self, table) -> TrigramReader:
        def read(before_root: int, root: int, widths: list[int]) -> tuple[list[int], list[float]]:
            tokens, probs = [root], [1.0]
            rows = table.rows_after(np.array([before_root]), np.array([root]))
            for width in widths:
                level = table.successors[rows, :width].ravel()
                tokens += level["token"].tolist()
                probs += level["prob"].tolist()
                rows = level["next"]
            return tokens, probs

        return read
