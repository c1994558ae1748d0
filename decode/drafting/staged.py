"""Staged speculative decoding's drafter: the trigram (and the context) draft for the draft model, which drafts the
oracle's tree."""
import torch

from decode.drafting.base import ModelDrafter
from decode.drafting.context import LookupDrafter
from decode.drafting.trigram import TrigramTrees
from decode.models.cached_lm import CachedLM
from decode.ranking import draw_below
from decode.sampling import Sampling
from decode.tree import Tree


class TrigramStage:
    """What a staged drafter adds to a model drafter: the trigram (`trigram`) and the context drafter (`context`,
    or None) that draft for the draft model, timed with it."""
    trigram: TrigramTrees
    context: LookupDrafter | None

    def forget(self) -> None:
        self.trigram.forget()

    def guess(self, tree: Tree, node: int, context: list[int], levels: int) -> list[int]:
        """Graft the trigram's tree below `node` of `tree` (at most `levels` deep; `context` ends with the node's
        token); returns `node` and the grafted nodes."""
        below, _ = self.trigram(context, levels)
        new = [node]
        for parent, token in zip(below.parents[1:], below.tokens[1:]):  # the trigram tree's node i is new[i]
            new.append(tree.add(new[parent], token))
        return new


class StagedDrafter(TrigramStage, ModelDrafter):
    """Staged speculative decoding: the trigram drafts for the draft model, which drafts for the oracle.
    One draft forward per step scores the unseen accepted tokens and the trigram's whole tree; the
    draft's own top children of every scored node join as candidate leaves. With a `context` drafter,
    the continuations it copies from the context join the tree and are always kept: a copy of what
    the sequence already did is accepted far more often than the draft's probabilities suggest.
    With `sampled` children (when sampling), the oracle's tree is drawn from the draft instead
    (`sampled_tree`): the trigram's tree decides where the draft's q is known after the step's first draft
    call; draws off it take one more draft call a level. Otherwise, with `draft_calls` above 1, the draft's own
    best path through the tree is carried on to the tree's depth by more draft calls (`extended`): the trigram
    drafts for the draft as the draft drafts for the oracle, so the draft's chain costs fewer calls than chain
    drafting's one a token."""

    def __init__(self, model: CachedLM, table, budget: int = 36, widths=(12, 7, 4, 1, 1, 1),
                 draft_children: int | None = None, context: "LookupDrafter | None" = None, depth: int = 8,
                 sampled: bool = False, draft_calls: int = 1):
        """`context` grafts its continuations from the context onto the trigram's tree (down to `depth`).
        `draft_children`: the draft's best children per node (None: 1), or its draws per node when the
        children are sampled (None: 2; measured best on the cpu preset at top-k 50). `draft_calls`: the most
        draft forwards a step makes to carry the draft's best path down to `depth`."""
        super().__init__(model, sampled)
        self.trigram, self.budget, self.draft_children = TrigramTrees(table, widths), budget, draft_children
        self.context, self.depth, self.draft_calls = context, depth, draft_calls

    def describe(self) -> dict:
        return {"widths": self.trigram.widths, "budget": self.budget, "draft_calls": self.draft_calls,
                "sampled": self.sampled, "context": self.context is not None}

    def sampled_tree(self, tree: Tree, logits: torch.Tensor, max_depth: int, sampling: Sampling, generator) -> Tree:
        """When sampling: `draft_children` independent draws from the draft's q below the root and below every draw,
        level by level, up to `budget` nodes, verified by multi-draft rejection. A draw that lands on a node of the
        trigram's tree (`tree`) has its q from the step's first draft call already; the level's other draws join
        `tree` and one more draft call scores them all. Only the rows drawn below get a proposal: its top-k costs
        microseconds a row, and most of the scored nodes are never drawn. Draws that repeat a token each get draws
        below; the budget stops a level at its first nodes, in their order, so which nodes get draws depends on
        the count of draws only, never on the tokens drawn."""
        count = self.draft_children or 2
        out, kept = Tree.rooted(tree.tokens[0]), [0]
        self.kept = kept
        first = len(tree)  # the nodes the step's first draft call scored: row i of `logits` is node i's
        later: dict = {}  # each node scored by a later call: (that call's logits, its row)
        level = [(0, 0)]  # (node of `out`, the node of `tree` it stands for): their children are drawn next
        while level := [(node, scored) for node, scored in level if out.depths[node] < max_depth][
                : (self.budget - len(out)) // count]:
            unscored = list(dict.fromkeys(n for _, n in level if n >= first and n not in later))  # a repeated draw: once
            if unscored:
                part = self.draft.score(tree, unscored)
                later.update((n, (part, row)) for row, n in enumerate(unscored))
            below_level = []
            drawn, qs = draw_below(self.kernels, sampling, [(logits, n) if n < first else later[n] for _, n in level], count,
                                   generator, self.draft.shortlist)
            for (node, scored), tokens, q in zip(level, drawn, qs):
                out.child_dists[node] = q
                below = {tree.tokens[c]: c for c in tree.children[scored]}
                for token in tokens:
                    if token not in below:  # a draw the trigram did not propose: a node of `tree` to score
                        below[token] = tree.add(scored, token)
                    child = out.add(node, token)
                    kept.append(below[token])
                    below_level.append((child, below[token]))
            level = below_level
        return out

    def propose(self, tokens: list[int], max_depth: int, sampling: Sampling, generator) -> Tree:
        self.draft.start(tokens)
        if self.draws(sampling):  # each level of draws takes `draft_children` nodes of the budget at least; a draw
            # lands on a node of the trigram's with the draft's probability of it: its `budget` likeliest are scored
            max_depth = min(max_depth, (self.budget - 1) // (self.draft_children or 2))
            tree = self.trigram.best(tokens, max_depth, self.budget).copy()
        else:
            tree, _ = self.trigram(tokens, max_depth)
        max_depth = min(max_depth, self.depth)
        copied = self.context.graft(tree, tokens, max_depth) if self.context is not None else set()
        n = len(tree)
        if self.draws(sampling):
            return self.sampled_tree(tree, self.draft.score(tree, list(range(n))), max_depth, sampling, generator)
        # The copied continuation, likeliest to be accepted, takes the draft's first slots: accepted, it is in place.
        order = [0] + sorted(copied) + [node for node in range(1, n) if node not in copied]
        logits = self.draft.score(tree, order)
        if self.draft_calls > 1:
            logits = self.extended(tree, order, logits, max_depth)
        # the `budget` candidates of highest cumulative draft weight among the tree's nodes and the draft's own best
        # children, the copied nodes first (decode.ranking.staged_selection)
        tree, self.kept = self.kernels.staged_selection(tree, logits, order, copied, max_depth, self.budget,
                                                        self.draft_children or 1, sampling, self.draft.shortlist)
        return tree

    def extended(self, tree: Tree, order: list[int], logits: torch.Tensor, max_depth: int) -> torch.Tensor:
        """Up to draft_calls - 1 more draft calls, each below the end of the draft's best path through `tree`
        (following its argmax from the root while the tree holds it): the argmax there joins the tree with the
        trigram's tree below it, and one call scores them. Stops once the path's next token would sit at
        `max_depth` (the selection adds it as the draft's leaf). Grows `tree` and `order`; returns the logits of
        every scored node, row i after order[i]."""
        best = dict(zip(order, self.kernels.row_argmax(logits, self.draft.shortlist)))
        parts, node = [logits], 0
        for _ in range(self.draft_calls - 1):
            while (child := next((c for c in tree.children[node] if tree.tokens[c] == best[node]), None)) is not None:
                node = child
            if tree.depths[node] + 1 >= max_depth:
                break
            token = best[node]
            node = tree.add(node, token)
            new = self.guess(tree, node, [tree.tokens[tree.parents[node]], token], max_depth - tree.depths[node])
            part = self.draft.score(tree, new)
            best.update(zip(new, self.kernels.row_argmax(part, self.draft.shortlist)))
            parts.append(part)
            order += new
        return torch.cat(parts) if len(parts) > 1 else logits
