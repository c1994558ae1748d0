"""Staged speculative decoding on a planned tree: Sequoia's shape filled by the draft model, as `ShapedTreeDrafter`
fills it, with the Katz trigram drafting for the draft."""
import torch

from decode.drafting.context import LookupDrafter
from decode.drafting.ranking import draw_children, ranking_scores
from decode.drafting.trees import ShapedTreeDrafter
from decode.drafting.trigram import TrigramTrees
from decode.models.cached_lm import CachedLM
from decode.sampling import Sampling, ranked_tokens
from decode.tree import Tree


class StagedShapeDrafter(ShapedTreeDrafter):
    """The oracle's tree is the planned shape, each node's children the draft's ranked tokens (or, when sampling, its
    draws), exactly as `ShapedTreeDrafter` makes it; what changes is how many draft calls that takes. Each draft call
    scores a level's nodes whose logits are not known yet together with the trigram's guesses below them (`widths[d]`
    children a node d levels below; with a `context` drafter, the continuations copied from the context below the
    root as well). A child whose token was guessed has its logits from that call, so the next level's call leaves it
    out, or is not made at all when every node of the level was guessed. The draft's tree of scored nodes
    (`self.scored`) holds the guesses too; `kept` maps the oracle's tree onto it."""

    def __init__(self, model: CachedLM, table, parents: list[int], ranks: list[int], widths=(1,),
                 context: LookupDrafter | None = None, sampled: bool = False):
        super().__init__(model, parents, ranks, sampled)
        self.trigram, self.context = TrigramTrees(table, widths), context
        self.ranks_read = max(self.widest)  # the draft's ranked tokens read a scored node (greedy)

    def reset(self) -> None:
        super().reset()
        if self.context is not None:
            self.context.reset()

    def forget(self) -> None:
        self.trigram.forget()

    def parts(self) -> dict[str, tuple[object, str]]:
        return {"trigram trees": (self.trigram, "build")}

    def describe(self) -> dict:
        return {"nodes": len(self.parents), "widths": self.trigram.widths, "context": self.context is not None,
                "sampled": self.sampled}

    def guess(self, scored: Tree, node: int, context: list[int], levels: int) -> list[int]:
        """Graft the trigram's tree below `node` of `scored` (at most `levels` deep; `context` ends with the node's
        token); returns `node` and the grafted nodes."""
        below, _ = self.trigram(context, levels)
        new = [node]
        for parent, token in zip(below.parents[1:], below.tokens[1:]):  # the trigram tree's node i is new[i]
            new.append(scored.add(new[parent], token))
        return new

    def propose(self, tokens: list[int], max_depth: int, sampling: Sampling, generator) -> Tree:
        depth = min(max_depth, len(self.parents))
        draws = self.draws(sampling)
        self.draft.start(tokens)
        scored = self.scored = Tree.rooted(tokens[-1])
        known = {}  # node of `scored` -> what its draft logits give: (logits, row) for draws, else its ranked tokens
        out, self.kept = Tree.rooted(tokens[-1]), [0]
        level = [(0, 0, 0)]  # (node of `out`, the node of `scored` it stands for, the shape node it fills)
        while level := [(node, s, shaped) for node, s, shaped in level if self.below[shaped] and out.depths[node] < depth]:
            unknown = list(dict.fromkeys(s for _, s, _ in level if s not in known))  # a repeated draw: once
            if unknown:
                fed = []
                for s in unknown:  # guesses below a node whose children have children of their own in the shape
                    levels = min(len(self.trigram.widths), depth - scored.depths[s] - 1)
                    context = tokens if s == 0 else [scored.tokens[scored.parents[s]], scored.tokens[s]]
                    fed += self.guess(scored, s, context, levels) if levels > 0 else [s]
                if unknown[0] == 0 and self.context is not None:  # the step's first call
                    first = len(scored)
                    fed += sorted(n for n in self.context.graft(scored, tokens, depth - 1) if n >= first)
                logits = self.draft.score(scored, fed)
                if draws:
                    known.update((s, (logits, row)) for row, s in enumerate(fed))
                else:
                    known.update(zip(fed, ranked_tokens(ranking_scores(logits, sampling), self.ranks_read,
                                                        self.draft.shortlist)))
            below_level = []
            for node, s, shaped in level:
                children = self.below[shaped]
                if draws:
                    rows, row = known[s]
                    [drawn], [out.child_dists[node]] = draw_children(sampling, rows, len(children), generator,
                                                                     self.draft.shortlist, [row])
                else:
                    drawn = [known[s][self.ranks[child]] for child in children]
                guessed = {scored.tokens[c]: c for c in scored.children[s]}
                for token, child in zip(drawn, children):
                    if token not in guessed:
                        guessed[token] = scored.add(s, token)
                    below_level.append((out.add(node, token), guessed[token], child))
                    self.kept.append(guessed[token])
            level = below_level
        return out
