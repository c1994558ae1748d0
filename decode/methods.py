"""The decoding methods, one entry each: what a method needs, how its drafter is built from the options, and how far
past the output a step of it may score."""
from dataclasses import dataclass
from typing import Callable

from decode.drafting import (ChainDrafter, Drafter, LookupDrafter, NgramDrafter, ShapedTreeDrafter, StagedDrafter,
                            StagedShapeDrafter, TreeDrafter)
from decode.models.cached_lm import CachedLM
from decode.options import DecoderOptions


@dataclass(frozen=True)
class Method:
    summary: str
    drafter: Callable[[DecoderOptions, CachedLM | None, object], Drafter] | None  # (options, draft, trigram); None: plain
    lookahead: Callable[[DecoderOptions], int]  # positions past the output a step may score
    draft: bool = False  # uses the draft model
    trigram: bool = False  # uses the Katz trigram
    tree: bool = False  # drafts a tree of at most `budget` nodes and `depth` levels
    planned: bool = True  # decode.plan chooses its policy


def context_drafter(o: DecoderOptions) -> LookupDrafter:
    return LookupDrafter(o.lookup_tokens, o.lookup_branches, o.lookup_ngram)


def tree_drafter(o: DecoderOptions, draft: CachedLM, table) -> Drafter:
    sampled = o.tree_children == "sampled"
    if o.tree_shape is not None:
        return ShapedTreeDrafter(draft, o.tree_shape.parents, o.tree_shape.ranks, sampled)
    return TreeDrafter(draft, o.budget, o.depth, *([o.branch] if o.branch is not None else []), sampled=sampled)


def staged_drafter(o: DecoderOptions, draft: CachedLM, table) -> Drafter:
    if o.tree_shape is not None and not o.widths:  # no stage below the draft (a plan's choice): the draft's tree alone
        return tree_drafter(o, draft, table)
    context = context_drafter(o) if o.context_drafter else None
    if o.tree_shape is not None:
        return StagedShapeDrafter(draft, table, o.tree_shape.parents, o.tree_shape.ranks, o.widths, context,
                                  sampled=o.tree_children == "sampled")
    return StagedDrafter(draft, table, o.budget, o.widths, o.branch, context, o.depth,
                         sampled=o.tree_children == "sampled", draft_calls=o.draft_calls)


def depth(o: DecoderOptions) -> int:
    return o.depth


METHODS = {
    "baseline": Method("the oracle alone", None, lambda o: 0, planned=False),
    "speculative": Method("chain drafts of --k tokens from the draft", lambda o, draft, table: ChainDrafter(draft, o.k),
                          lambda o: o.k, draft=True),
    "tree": Method("trees of the draft's tokens", tree_drafter, depth, draft=True, tree=True),
    "staged": Method("trigram (and context) -> draft -> oracle trees", staged_drafter, depth, draft=True, trigram=True,
                     tree=True),
    "ngram": Method("trigram trees", lambda o, draft, table: NgramDrafter(table, o.budget, o.widths), depth,
                    trigram=True, tree=True),
    "lookup": Method("continuations found in the context (prompt lookup), no model",
                     lambda o, draft, table: context_drafter(o), lambda o: o.lookup_tokens),
}
