"""What a drafter is: the interface the speculative loop drafts through, and the two kinds of drafter.

    reset()                                     a new sequence follows
    propose(tokens, max_depth, sampling, rng)   a tree rooted at tokens[-1] for the oracle to verify (rng: the loop's
                                                sampling.Uniforms, which a drafter that draws reads)
    chain_call(tokens, max_depth, sampling, rng)
                                                propose's first half, where its tree is one chain of the draft model's
                                                forwards: the ChainCall (None: propose drafts it otherwise)
    chained(call, chosen)                       propose's second half: the tree from what the chain call gave
    accept(path)                                the nodes of the last tree the oracle accepted, root first
    draws(sampling)                             whether its trees hold draws from the draft (multi-draft rejection
                                                verifies them) or its ranked tokens (sample-match)
    calls                                       the draft model's forwards since the last reset
    forget()                                    drop what it remembers across sequences (the trigram's trees)
    describe()                                  what it drafts with, for reports

A drafter that drafts with the Katz trigram holds its trees as `trigram` (drafting.trigram.TrigramTrees), whose
`build` a profile times.
"""
from dataclasses import dataclass
from typing import Protocol

from decode.drafting.draft_cache import DraftCache
from decode.models.cached_lm import CachedLM, ChainCall
from decode.sampling import Sampling, Uniforms
from decode.tree import Tree


class Drafter(Protocol):
    @property
    def calls(self) -> int: ...

    def reset(self) -> None: ...

    def propose(self, tokens: list[int], max_depth: int, sampling: Sampling, generator: Uniforms) -> Tree: ...

    def chain_call(self, tokens: list[int], max_depth: int, sampling: Sampling, generator: Uniforms
                   ) -> ChainCall | None: ...

    def chained(self, call: ChainCall, chosen: tuple[list[int], list | None]) -> Tree: ...

    def accept(self, path: list[int]) -> None: ...

    def draws(self, sampling: Sampling) -> bool: ...

    def forget(self) -> None: ...

    def describe(self) -> dict: ...


@dataclass
class Proposal:
    """A step's request for its drafter's tree, which a decoding loop yields to whoever runs it (decode.loop): `run`
    proposes it alone; decode.batch proposes several sequences' trees at once, their draft chains as one call."""

    drafter: Drafter
    tokens: list[int]
    max_depth: int
    sampling: Sampling
    generator: Uniforms

    def run(self) -> Tree:
        return self.drafter.propose(self.tokens, self.max_depth, self.sampling, self.generator)


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

    def chain_steps(self, max_depth: int) -> int:
        """The draft calls of a step whose tree is a chain of the draft's tokens (0: this drafter's trees are not)."""
        return 0

    def chain_call(self, tokens: list[int], max_depth: int, sampling: Sampling, generator: Uniforms
                   ) -> ChainCall | None:
        """Start a step (the draft's cache past `tokens`) and, where its tree is a chain (`chain_steps`) that the
        draft model makes in one call (DraftCache.chain_call), that call: greedy, each token the argmax after the one
        above; sampling, draws. Run alone (`propose`) or beside other sequences' chains (decode.batch), `chained`
        makes the tree of what it gave. None where it does not, or where this drafter's children are ranked tokens
        under sampling: the drafter then scores node by node."""
        self.draft.start(tokens)
        steps = self.chain_steps(max_depth)
        if not steps or not (sampling.greedy or self.draws(sampling)):
            return None
        return self.draft.chain_call(steps, sampling, generator)

    def chained(self, call: ChainCall, chosen: tuple[list[int], list | None]) -> Tree:
        """The step's tree from what its chain call gave: the chain below the root, each node's q recorded when
        sampling."""
        tree, (drawn, qs) = Tree.rooted(int(call.token_ids[-1])), self.draft.chained(call, chosen)
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

    def chain_call(self, tokens: list[int], max_depth: int, sampling: Sampling, generator: Uniforms) -> None:
        return None  # no draft model to chain

    def chained(self, call: ChainCall, chosen: tuple[list[int], list | None]) -> Tree:
        raise TypeError("a drafter without a draft model makes no chain call")
