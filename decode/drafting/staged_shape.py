"""Staged speculative decoding on a planned tree: Sequoia's shape filled by the draft model, as `ShapedTreeDrafter`
fills it, with the Katz trigram drafting for the draft."""
from decode.drafting.context import LookupDrafter
from decode.drafting.staged import TrigramStage
from decode.drafting.trees import ShapedTreeDrafter
from decode.drafting.trigram import TrigramTrees
from decode.models.cached_lm import CachedLM
from decode.ranking import draw_below, ranking_scores
from decode.sampling import Sampling
from decode.tree import Tree


class StagedShapeDrafter(TrigramStage, ShapedTreeDrafter):
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
        self.ranks_read = max(1, *self.widest)  # the draft's ranked tokens read a scored node (greedy)

    def describe(self) -> dict:
        return {"nodes": len(self.parents), "widths": self.trigram.widths, "context": self.context is not None,
                "sampled": self.sampled}

    def propose(self, tokens: list[int], max_depth: int, sampling: Sampling, generator) -> Tree:
        shape, levels = self.layout(max_depth)
        depth, draws = len(levels), self.draws(sampling)
        out = shape.copy([tokens[-1]] + shape.tokens[1:])
        kept = self.kept = [0] * len(out)  # node of `out` -> the node of `scored` it stands for
        self.draft.start(tokens)
        scored = self.scored = Tree.rooted(tokens[-1])
        known: dict = {}  # node of `scored` -> what its draft logits give: (logits, row) for draws, else its ranked tokens
        calls: tuple = ()  # the step's draft calls so far, as the structure they fed: names a call's layout (`repeats`)
        for nodes, _, draws_most, children in levels:
            at = [kept[node] for node in nodes]
            if unknown := list(dict.fromkeys(s for s in at if s not in known)):  # a repeated draw's node: once
                fed: list[int] = []
                for s in unknown:  # the trigram's guesses below, where their own children are in the tree
                    below = min(len(self.trigram.widths), depth - scored.depths[s] - 1)
                    context = tokens if s == 0 else [scored.tokens[scored.parents[s]], scored.tokens[s]]
                    fed += self.guess(scored, s, context, below) if below > 0 else [s]
                if unknown[0] == 0 and self.context is not None:  # the step's first call
                    first = len(scored)
                    fed += sorted(n for n in self.context.graft(scored, tokens, depth - 1) if n >= first)
                calls = (calls, tuple(scored.parents), tuple(fed))
                logits = self.draft.score(scored, fed, repeats=calls)
                if draws:
                    known.update((s, (logits, row)) for row, s in enumerate(fed))
                else:
                    known.update(zip(fed, self.kernels.top_tokens(ranking_scores(logits, sampling), self.ranks_read,
                                                                   self.draft.shortlist)))
            if draws:  # each node's children are as many draws from its q (a node with fewer leaves the rest)
                drawn, qs = draw_below(self.kernels, sampling, [known[s] for s in at], draws_most, generator, self.draft.shortlist)
                out.child_dists.update(zip(nodes, qs))
            for child, row, place, rank in children:
                s = at[row]
                token = out.tokens[child] = drawn[row][place] if draws else known[s][rank]
                guessed = next((c for c in scored.children[s] if scored.tokens[c] == token), None)
                kept[child] = scored.add(s, token) if guessed is None else guessed
        return out
