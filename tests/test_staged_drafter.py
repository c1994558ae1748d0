"""The staged drafter sampling and on a planned shape: children drawn from the draft's distribution below the
trigram's tree, budgets, the draft's cache left on the accepted tokens, and a shape's tree in fewer draft calls."""
import pytest
import torch
from decode_models import SHAPE, oracle_contexts

from decode.drafting import ChainDrafter, LookupDrafter, ShapedTreeDrafter, StagedDrafter, StagedShapeDrafter
from decode.loop import baseline, tree_speculative
from decode.models.engine import GPT2Engine
from decode.models.successors import SuccessorTable
from decode.sampling import Sampling, Uniforms


@pytest.fixture(scope="module")
def models(tree_run_models):
    return tree_run_models


def test_staged_sampled_children_are_draws_below_every_draw_scored_in_one_more_call_off_the_trigrams_tree(models):
    draft = GPT2Engine.load(models["good"])
    table = SuccessorTable.load(models["ngram"] / "successors.npz")
    sampling = Sampling(1.0, top_k=8)
    staged = StagedDrafter(draft, table, budget=15, widths=[3, 2, 1], sampled=True)
    generator = Uniforms(torch.Generator().manual_seed(3))
    on_trigram = off_trigram = 0
    for tokens in [[4, 9, 17], [1, 2, 3, 4], [30, 31]] * 10:  # until draws have landed on both kinds of node
        if on_trigram and off_trigram:
            break
        staged.reset()
        tree = staged.propose(tokens, 10, sampling, generator)
        scored = staged.trigram.best(tokens, 10, 15)  # the step's first draft call: the trigram's 15 likeliest nodes
        assert staged.draws(sampling) and tree.tokens[0] == tokens[-1] and staged.kept[0] == 0
        assert len(tree) == 15 and tree.depths == sorted(tree.depths)  # levels of 2, 4, 8 draws: the budget's
        for node in range(len(tree)):
            kept = staged.kept[node]
            if kept < len(scored):
                assert tree.tokens[node] == scored.tokens[kept]
            if tree.depths[node] < 3:
                assert len(tree.children[node]) == 2  # the default draws per node, duplicates kept as drawn
                q = tree.child_dists[node]
                assert sum(q.values()) == pytest.approx(1) and 0 < len(q) <= 8  # the draft's top-k distribution
                assert all(q[tree.tokens[c]] > 0 for c in tree.children[node])
                on_trigram += 0 < kept < len(scored)
                off_trigram += kept >= len(scored)
        assert staged.calls == 1 + len({d for n, d in enumerate(tree.depths) if staged.kept[n] >= len(scored)
                                        and tree.children[n]})  # one more draft call per level that left the trigram's tree
    assert on_trigram > 0 and off_trigram > 0  # draws below nodes the first call scored, and below ones it did not


def test_staged_sampled_trees_stop_at_the_budget_at_the_first_nodes_of_a_level(models):
    """Repeated draws each get draws below: uncapped, a confident draft multiplies a path (3 draws a node once
    made trees of 3,589 nodes on the cpu preset). The budget stops the drawing at the first nodes of a level."""
    draft = GPT2Engine.load(models["good"])
    table = SuccessorTable.load(models["ngram"] / "successors.npz")
    sampling = Sampling(1.0, top_k=1)  # one token to draw: every draw repeats the draft's best
    # the draft's own greedy text: it falls into a loop, which the context drafter grafts and the draft's best
    # token follows, so every draw lands on a node the draft scored
    contexts = [start + baseline(draft, torch.tensor(start), 60, Sampling(), ()).tokens
                for start in ([4, 9, 17], [1, 2, 3], [30, 31, 32])]

    def trees(budget):
        staged = StagedDrafter(draft, table, budget=budget, widths=[3, 2, 1], draft_children=3,
                               context=LookupDrafter(8, 1), depth=6, sampled=True)
        generator = Uniforms(torch.Generator().manual_seed(5))
        out = []
        for tokens in contexts:
            staged.reset()
            out.append((staged.propose(tokens, 10, sampling, generator), staged.kept))
        return out

    assert max(len(tree) for tree, _ in trees(10_000)) > 100  # the multiplication the budget is for
    for tree, _ in trees(10):
        assert len(tree) <= 10
        for depth in range(max(tree.depths)):
            drawable = [n for n in range(len(tree)) if tree.depths[n] == depth]
            drawn = [n in tree.child_dists for n in drawable]
            assert drawn == sorted(drawn, reverse=True)  # the nodes with draws come first in their level
            assert all(len(tree.children[n]) == 3 for n in drawable if n in tree.child_dists)


def test_staged_sampled_children_leave_the_drafts_cache_on_the_accepted_tokens(models):
    """The draft commits the accepted draws it scored; its next logits must be a fresh prefill's."""
    oracle, draft = GPT2Engine.load(models["oracle"]), GPT2Engine.load(models["good"])
    table = SuccessorTable.load(models["ngram"] / "successors.npz")
    sampling = Sampling(1.0)
    staged = StagedDrafter(draft, table, widths=[3, 2, 1], sampled=True)
    generator = torch.Generator().manual_seed(4)
    for prompt in ([4, 9, 17], [1, 2, 3, 4, 5]):
        out = tree_speculative(oracle, torch.tensor(prompt), 30, sampling, (), generator=generator, drafter=staged)
        tokens = prompt + out.tokens
        assert out.draft_calls >= out.oracle_calls - 1 and len(out.tokens) / out.oracle_calls > 1.5
        assert 0 < draft.length < len(tokens)
        fresh = GPT2Engine.load(models["good"])
        expected = fresh.extend(torch.tensor(tokens))[-1]
        assert torch.allclose(draft.extend(torch.tensor(tokens[draft.length:]))[-1], expected, atol=1e-4)


@pytest.mark.parametrize("context", [False, True])
@pytest.mark.parametrize("max_depth", [2, 8])
def test_staged_on_a_shape_is_the_shaped_drafters_tree_in_fewer_draft_calls(models, context, max_depth):
    """Greedy, the staged tree on a planned shape holds the shaped drafter's tokens node for node: the trigram's (and
    the context's) guesses decide which draft call scores a node, never the tree. Where they guess the draft's
    tokens, a step takes fewer calls than the shape's one a level."""
    table = SuccessorTable.load(models["ngram"] / "successors.npz")
    shaped = ShapedTreeDrafter(GPT2Engine.load(models["good"]), **SHAPE)
    staged = StagedShapeDrafter(GPT2Engine.load(models["good"]), table, **SHAPE, widths=[2, 1],
                                context=LookupDrafter(4) if context else None)
    calls, contexts = {"shaped": 0, "staged": 0}, oracle_contexts(models, 24)
    for tokens in contexts:
        trees = {}
        for name, drafter in (("shaped", shaped), ("staged", staged)):
            drafter.reset()
            trees[name] = drafter.propose(tokens, max_depth, Sampling(), None)
            calls[name] += drafter.calls
        assert trees["staged"].tokens == trees["shaped"].tokens and trees["staged"].parents == trees["shaped"].parents
        scored = staged.scored
        assert [scored.tokens[n] for n in staged.kept] == trees["staged"].tokens  # each node is the one the draft scored
        assert all(scored.parents[staged.kept[n]] == staged.kept[p] for n, p in enumerate(trees["staged"].parents) if n)
    assert calls["staged"] < calls["shaped"] == len(contexts) * min(max_depth, 4)


def test_staged_on_a_shape_draws_each_nodes_children_from_the_drafts_distribution_there(models):
    """Sampled, a node's draws come from the draft's q after that node's own path, whichever call scored it: ahead,
    as a guess of the trigram's or the context's, or in its level's call."""
    table = SuccessorTable.load(models["ngram"] / "successors.npz")
    draft, fresh = GPT2Engine.load(models["good"]), GPT2Engine.load(models["good"])
    staged = StagedShapeDrafter(draft, table, **SHAPE, widths=[2, 1], context=LookupDrafter(4), sampled=True)
    sampling, generator = Sampling(1.0, top_k=6), Uniforms(torch.Generator().manual_seed(2))
    guessed = 0
    for tokens in oracle_contexts(models, 8):
        staged.reset()
        tree = staged.propose(tokens, 8, sampling, generator)
        assert tree.parents == SHAPE["parents"] and set(tree.child_dists) == {0, 1, 2, 3, 6}
        for node, q in tree.child_dists.items():
            fresh.reset()
            logits = fresh.extend(torch.tensor(tokens + [tree.tokens[n] for n in tree.path(node)[1:]]))[-1:]
            [expected] = sampling.distributions(logits.float().contiguous())
            assert q.keys() == expected.keys() and list(q.values()) == pytest.approx(list(expected.values()), abs=1e-5)
            assert all(q[tree.tokens[c]] > 0 for c in tree.children[node])
        guessed += 5 - (staged.calls - 1)  # nodes with draws less the calls past the first: scored ahead
    assert guessed > 0


@pytest.mark.parametrize("sampled", [False, True])
def test_staged_on_a_shape_leaves_the_drafts_cache_on_the_accepted_tokens(models, sampled):
    oracle, draft = GPT2Engine.load(models["oracle"]), GPT2Engine.load(models["good"])
    table = SuccessorTable.load(models["ngram"] / "successors.npz")
    staged = StagedShapeDrafter(draft, table, **SHAPE, widths=[2, 1], context=LookupDrafter(4), sampled=sampled)
    sampling, generator = Sampling(1.0) if sampled else Sampling(), torch.Generator().manual_seed(4)
    for prompt in ([4, 9, 17], [1, 2, 3, 4, 5]):
        out = tree_speculative(oracle, torch.tensor(prompt), 30, sampling, (), generator=generator, drafter=staged)
        tokens = prompt + out.tokens
        assert len(out.tokens) / out.oracle_calls > 1.5 and 0 < draft.length < len(tokens)
        expected = GPT2Engine.load(models["good"]).extend(torch.tensor(tokens))[-1]
        assert torch.allclose(draft.extend(torch.tensor(tokens[draft.length:]))[-1], expected, atol=1e-4)


@pytest.mark.parametrize("shape", ["chain", "tree", "staged"])
def test_remembered_draft_calls_feed_the_draft_what_fresh_ones_do(models, monkeypatch, shape):
    """Steps of one shape remember each draft call's slots, mask and positions (DraftModel.score's `repeats`): the
    draft must be fed exactly what working them out afresh feeds it, whatever the unseen tokens, and its cache must
    end on the accepted tokens."""
    oracle = GPT2Engine.load(models["oracle"])
    fed = {}
    for remembered in (True, False):
        draft = GPT2Engine.load(models["good"])
        table = SuccessorTable.load(models["ngram"] / "successors.npz")
        drafter = {"chain": lambda draft=draft: ChainDrafter(draft, k=3),
                   "tree": lambda draft=draft: ShapedTreeDrafter(draft, parents=[-1, 0, 0, 1, 1, 2, 3],
                                                                ranks=[0, 0, 1, 0, 1, 0, 0]),
                   "staged": lambda draft=draft, table=table: StagedShapeDrafter(draft, table, **SHAPE, widths=[2, 1],
                                                                                 context=LookupDrafter(4))
                   }[shape]()
        calls, forward, score = fed.setdefault(remembered, []), draft.forward, drafter.draft.score

        def recording(ids, positions, mask, last=None, calls=calls, forward=forward):
            calls.append((list(ids), list(positions), None if mask is None else mask.tolist(), last))
            return forward(ids, positions, mask, last)

        monkeypatch.setattr(draft, "forward", recording)
        if not remembered:
            monkeypatch.setattr(drafter.draft, "score", lambda tree, nodes, repeats=None, score=score: score(tree, nodes))
        for prompt in ([4, 9, 17], [1, 2, 3, 4, 5, 6, 7], [30]):
            out = tree_speculative(oracle, torch.tensor(prompt), 30, Sampling(), (), drafter=drafter)
            fresh = GPT2Engine.load(models["good"])
            tokens = prompt + out.tokens
            expected = fresh.extend(torch.tensor(tokens))[-1]
            assert torch.allclose(draft.extend(torch.tensor(tokens[draft.length :]))[-1], expected, atol=1e-4)
        known = drafter.draft.known
        # staged's calls vary with the guesses that came true: fewer of them repeat
        assert (0 < len(known) < len(calls) / (1 if shape == "staged" else 2)) if remembered else not known
    assert fed[True] == fed[False]
    assert len({len(ids) for ids, *_ in fed[True]}) > 2  # steps began with different numbers of unseen tokens
