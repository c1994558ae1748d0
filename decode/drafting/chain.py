"""Standard speculative decoding's drafter: a chain of the draft model's tokens."""
from decode.drafting.base import ModelDrafter
from decode.models.cached_lm import CachedLM
from decode.ranking import draw_children
from decode.sampling import Sampling
from decode.tree import Tree


class ChainDrafter(ModelDrafter):
    """k tokens from the draft model one after another: its argmax when greedy (verified by
    sample-match), else samples from q (verified by rejection sampling)."""

    def __init__(self, model: CachedLM, k: int):
        super().__init__(model, sampled=True)
        self.k = k

    def describe(self) -> dict:
        return {"k": self.k}

    def propose(self, tokens: list[int], max_depth: int, sampling: Sampling, generator) -> Tree:
        self.draft.start(tokens)
        steps = min(self.k, max_depth)
        if (chained := self.chain(tokens[-1], steps, sampling, generator)) is not None:
            return chained
        tree = Tree.rooted(tokens[-1])
        node, draws = 0, self.draws(sampling)
        for _ in range(steps):
            logits = self.draft.score(tree, [node], repeats=node)  # every step's tree is a chain
            if draws:
                [[token]], [q] = draw_children(self.kernels, sampling, logits, 1, generator, self.draft.shortlist)
                tree.child_dists[node] = q
            else:
                token = self.kernels.row_argmax(logits, self.draft.shortlist)[0]
            node = tree.add(node, token)
        return tree
