"""The decoding methods, one entry each: what a method needs, how its drafter is built from the options, and how far
past the output a step of it may score."""
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from decode.drafting import ChainDrafter, Drafter, LookupDrafter, NgramDrafter, ShapedTreeDrafter, StagedDrafter, StagedShapeDrafter, TreeDrafter
from decode.errors import InputError
from decode.models.cached_lm import CachedLM
from decode.models.engine import SPECULATIVE_SLOTS
from decode.options import MAX_BUDGET, MAX_DEPTH, DecoderOptions


@dataclass(frozen=True)
class Method:
    summary: str
    drafter: Callable[..., Drafter] | None  # (options, draft, trigram) of checked options; None: plain decoding
    lookahead: Callable[[DecoderOptions], int]  # positions past the output a step may score
    rows: Callable[[DecoderOptions], int]  # the most nodes a step asks the oracle to score
    lookahead_setting: str = "depth"  # the DecoderOptions field that sets it
    draft: bool = False  # uses the draft model
    trigram: bool = False  # uses the Katz trigram
    tree: bool = False  # drafts a tree of at most `budget` nodes and `depth` levels
    planned: bool = True  # decode.plan chooses its policy


def context_drafter(o: DecoderOptions) -> LookupDrafter:
    return LookupDrafter(o.lookup_tokens, o.lookup_branches, o.lookup_ngram)


def budget(o: DecoderOptions) -> int:
    """The tree's budget of checked options (DecoderOptions.check sizes it for the device where it was None)."""
    assert o.budget is not None, "the options are checked before a drafter is built"
    return o.budget


def tree_drafter(o: DecoderOptions, draft: CachedLM, table) -> Drafter:
    sampled = o.tree_children == "sampled"
    if o.tree_shape is not None:
        return ShapedTreeDrafter(draft, o.tree_shape.parents, o.tree_shape.ranks, sampled)
    if o.branch is None:
        return TreeDrafter(draft, budget(o), o.depth, sampled=sampled)
    return TreeDrafter(draft, budget(o), o.depth, o.branch, sampled=sampled)


def staged_drafter(o: DecoderOptions, draft: CachedLM, table) -> Drafter:
    if o.tree_shape is not None and not o.widths:  # no stage below the draft (a plan's choice): the draft's tree alone
        return tree_drafter(o, draft, table)
    context = context_drafter(o) if o.context_drafter else None
    if o.tree_shape is not None:
        return StagedShapeDrafter(draft, table, o.tree_shape.parents, o.tree_shape.ranks, o.widths, context,
                                  sampled=o.tree_children == "sampled")
    return StagedDrafter(draft, table, budget(o), o.widths, o.branch, context, o.depth,
                         sampled=o.tree_children == "sampled", draft_calls=o.draft_calls)


def depth(o: DecoderOptions) -> int:
    return o.depth


def tree_nodes(o: DecoderOptions) -> int:
    return len(o.tree_shape.parents) if o.tree_shape is not None else budget(o)


def lookup_nodes(o: DecoderOptions) -> int:
    return 1 + o.lookup_tokens * o.lookup_branches


METHODS = {
    "baseline": Method("the oracle alone", None, lambda o: 0, lambda o: 1, planned=False),
    "speculative": Method("chain drafts of --k tokens from the draft", lambda o, draft, table: ChainDrafter(draft, o.k),
                          lambda o: o.k, lambda o: o.k + 1, "k", draft=True),
    "tree": Method("trees of the draft's tokens", tree_drafter, depth, tree_nodes, draft=True, tree=True),
    "staged": Method("trigram (and context) -> draft -> oracle trees", staged_drafter, depth, tree_nodes, draft=True,
                     trigram=True, tree=True),
    "ngram": Method("trigram trees", lambda o, draft, table: NgramDrafter(table, budget(o), o.widths), depth, tree_nodes,
                    trigram=True, tree=True),
    "lookup": Method("continuations found in the context (prompt lookup), no model",
                     lambda o, draft, table: context_drafter(o), lambda o: o.lookup_tokens, lookup_nodes,
                     "lookup_tokens"),
}


def check_options(options: DecoderOptions) -> DecoderOptions:
    """`options.check()` for a method of METHODS: InputError for an unknown one."""
    if options.method not in METHODS:
        raise InputError(f"unknown method {options.method!r}; choose from {', '.join(METHODS)}")
    return options.check()


def check_tree_shape(options, table) -> None:
    """Budget, depth and widths must describe a tree the drafters can build."""
    if not 2 <= options.budget <= MAX_BUDGET:
        raise InputError(f"--budget {options.budget} is out of range: the oracle's tree needs 2 to {MAX_BUDGET} nodes")
    if not 1 <= options.depth <= MAX_DEPTH:
        raise InputError(f"--depth {options.depth} is out of range: use 1 to {MAX_DEPTH}")
    if options.branch is not None and options.branch < 1:
        raise InputError(f"--branch {options.branch} must be at least 1")
    if not 1 <= options.draft_calls <= options.depth:
        raise InputError(f"--draft-calls {options.draft_calls} is out of range: use 1 to --depth {options.depth}")
    if METHODS[options.method].trigram:
        # staged on a planned shape: the trigram guesses below the shape's nodes, as deep as the shape reaches
        shaped = options.tree_shape is not None
        if any(w < 1 for w in options.widths) or (len(options.widths) > options.depth and not shaped) or (
                not options.widths and not shaped):
            raise InputError(f"--widths {options.widths} need a positive width per level and at most --depth {options.depth} levels")
        if options.widths and max(options.widths) > table.k:
            raise InputError(f"--widths {options.widths} ask for {max(options.widths)} trigram children but {options.ngram} keeps "
                             f"only the top {table.k}; rebuild it with --successors {max(options.widths)} or narrow the widths")
        if not shaped and options.widths[0] + 1 > options.budget:
            raise InputError(f"--widths {options.widths} do not fit --budget {options.budget}: the first level alone has "
                             f"{options.widths[0]} nodes; raise the budget or narrow the first width")
    if options.method == "staged":  # the draft scores the trigram's whole tree, and the context's continuations, in one call
        levels = np.cumprod(options.widths[: options.depth])
        scored = 1 + int(levels.sum()) + (options.lookup_tokens * options.lookup_branches if options.context_drafter else 0)
        if options.tree_shape is not None:  # at most every node of the shape scored with a trigram tree below it
            scored += (len(options.tree_shape.parents) - 1) * (1 + int(levels.sum()))
        else:
            scored += (options.draft_calls - 1) * (1 + int(levels.sum()))  # each later call: a trigram tree at most
        if scored > SPECULATIVE_SLOTS:
            raise InputError(f"--widths {','.join(map(str, options.widths))} make a trigram tree of {1 + int(levels.sum()):,} nodes, "
                             f"which the draft scores in one call (with the context's continuations and --draft-calls "
                             f"{options.draft_calls}, {scored:,} nodes a step); its cache holds at most "
                             f"{SPECULATIVE_SLOTS:,}: narrow the widths or make fewer draft calls")
