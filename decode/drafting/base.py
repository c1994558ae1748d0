"""What a drafter is: the interface the speculative loop drafts through, and the two kinds of drafter.

    reset()                                     a new sequence follows
    propose(tokens, max_depth, sampling, rng)   a tree rooted at tokens[-1] for the oracle to verify (rng: the loop's
                                                sampling.Uniforms, which a drafter that draws reads)
    accept(path)                                the nodes of the last tree the oracle accepted, root first
    draws(sampling)                             whether its trees hold draws from the draft (multi-draft rejection
                                                verifies them) or its ranked tokens (sample-match)
    calls                                       the draft model's forwards since the last reset
    forget()                                    drop what it remembers across sequences (the trigram's trees)
    describe()                                  what it drafts with, for reports

A drafter that drafts with the Katz trigram holds its trees as `trigram` (drafting.trigram.TrigramTrees), whose
`build` a profile times.
"""
from typing import Protocol

from decode.drafting.draft_cache import DraftCache
from decode.models.cached_lm import CachedLM
from decode.sampling import Sampling, Uniforms
from decode.tree import Tree


class Drafter(Protocol):
    @property
    def calls(self) -> int: ...

    def reset(self) -> None: ...

    def propose(self, tokens: list[int], max_depth: int, sampling: Sampling, generator: Uniforms) -> Tree: ...

    def accept(self, path: list[int]) -> None: ...

    def draws(self, sampling: Sampling) -> bool: ...

    def forget(self) -> None: ...

    def describe(self) -> dict: ...


class ModelDrafter:
    """A drafter that uses the draft model. `propose` builds the tree; when it prunes a larger tree,
    `kept` maps each proposed node to the node the draft model scored (None: a node it did not score). Its loops
    over the draft's logits are the model's runtime's `kernels`."""

    def __init__(self, model: CachedLM, sampled: bool = False):
        self.draft, self.sampled = DraftCache(model), sampled
        self.kernels = model.runtime.kernels
        self.kept: list[int] | None = None

    def draws(self, sampling: Sampling) -> bool:
        """Children drawn from the draft, verified by multi-draft rejection, rather than its top tokens,
        verified by sample-match. Only when sampling: a greedy draft's point mass has nothing to draw."""
        return self.sampled and not sampling.greedy

    def reset(self) -> None:
        self.draft.reset()

    def forget(self) -> None:
        pass

    @property
    def calls(self) -> int:
        return self.draft.calls

    def accept(self, path: list[int]) -> None:
        self.draft.accept([self.kept[n] for n in path] if self.kept is not None else path)

    def chain(self, root: int, steps: int, sampling: Sampling, generator: Uniforms) -> Tree | None:
        """The step's tree as a chain of `steps` tokens below `root` from one call of the draft model's, where it makes
        a chain's forwards at once (DraftCache.chain; the step started): greedy, each token the argmax after the one
        above; sampling, draws, each node's q recorded. None where it does not, or where this drafter's children are
        ranked tokens under sampling: the drafter then scores node by node."""
        drawn_or_best = sampling.greedy or self.draws(sampling)
        chained = self.draft.chain(steps, sampling, generator) if steps and drawn_or_best else None
        if chained is None:
            return None
        tree, (drawn, qs) = Tree.rooted(root), chained
        for node, token in enumerate(drawn):
            if qs is not None:
                tree.child_dists[node] = qs[node]
            tree.add(node, token)
        return tree


class ModelFreeDrafter:
    """A drafter without a draft model: no draft calls, nothing to commit."""

    calls = 0

    def draws(self, sampling: Sampling) -> bool:
        return False

    def reset(self) -> None:
        pass

    def forget(self) -> None:
        pass

    def accept(self, path: list[int]) -> None:
        pass
