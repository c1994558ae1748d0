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

    def chain_steps(self, max_depth: int) -> int:
        return min(self.k, max_depth)

    def propose(self, tokens: list[int], max_depth: int, sampling: Sampling, generator) -> Tree:
        if (call := self.chain_call(tokens, max_depth, sampling, generator)) is not None:
            return self.chained(call, call.run())
        tree = Tree.rooted(tokens[-1])
        node, draws = 0, self.draws(sampling)
        for _ in range(self.chain_steps(max_depth)):
            logits = self.draft.score(tree, [node], repeats=node)  # every step's tree is a chain
            if draws:
                [[token]], [q] = draw_children(self.kernels, sampling, logits, 1, generator, self.draft.shortlist)
                tree.child_dists[node] = q
            else:
                token = self.kernels.row_argmax(logits, self.draft.shortlist)[0]
            node = tree.add(node, token)
        return tree
