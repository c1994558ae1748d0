"""Drafters: each proposes a tree rooted at the last accepted token for the oracle to verify (decode.drafting.base
says what a drafter does).

    chain    ChainDrafter        the draft model proposes k tokens one after another (standard speculative decoding)
    tree     TreeDrafter         the draft model expands the nodes of highest cumulative probability, a few children each
    shaped   ShapedTreeDrafter   the draft model fills a fixed tree of ranks, a level per call (Sequoia; decode.plan's)
    staged   StagedDrafter       the Katz trigram proposes a tree, the draft model scores all of it in one forward, and
                                 the best `budget` nodes by cumulative draft probability are kept
    staged   StagedShapeDrafter  the draft model fills a planned shape as ShapedTreeDrafter does, each of its calls
                                 scoring the trigram's guesses of the next level too (decode.plan's)
    ngram    NgramDrafter        the trigram alone, ranked by cumulative trigram probability
    lookup   LookupDrafter       the continuations of the current suffix's earlier occurrences in the context, no model
"""
from decode.drafting.base import Drafter, Proposal
from decode.drafting.chain import ChainDrafter
from decode.drafting.context import LookupDrafter
from decode.drafting.staged import StagedDrafter
from decode.drafting.staged_shape import StagedShapeDrafter
from decode.drafting.trees import ShapedTreeDrafter, TreeDrafter
from decode.drafting.trigram import NgramDrafter, TrigramTrees

__all__ = ["ChainDrafter", "Drafter", "LookupDrafter", "NgramDrafter", "Proposal", "ShapedTreeDrafter",
           "StagedDrafter", "StagedShapeDrafter", "TreeDrafter", "TrigramTrees"]
