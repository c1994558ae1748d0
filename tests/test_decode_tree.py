"""Trees and the tree drafters: masks and subtrees, every drafter's greedy decoding equal to the baseline, sample
match, the context's continuations, best-first ranking and the trigram's trees."""
import numpy as np
import pytest
import torch
from decode_models import SHAPE

from decode.drafting import ChainDrafter, LookupDrafter, NgramDrafter, StagedDrafter, StagedShapeDrafter, TreeDrafter, TrigramTrees
from decode.kernels import PortableKernels
from decode.loop import baseline, tree_speculative
from decode.models.engine import GPT2Engine
from decode.models.runtime import host_kernels
from decode.models.successors import SuccessorTable
from decode.sampling import Sampling, Uniforms, sample
from decode.tree import Tree
from decode.verify import Target, sample_match


@pytest.fixture(scope="module")
def models(tree_run_models):
    return tree_run_models


def example_tree() -> Tree:
    tree = Tree.rooted(5)
    a, b = tree.add(0, 7), tree.add(0, 9)
    c = tree.add(a, 11)
    tree.add(c, 13)
    tree.add(b, 2)
    return tree


def test_mask_shows_each_node_the_prefix_and_exactly_its_ancestors():
    tree = example_tree()
    mask = tree.mask()
    assert mask.shape == (6, 6)
    for node in range(len(tree)):
        assert set(mask[node].nonzero().flatten().tolist()) == set(tree.path(node))
    assert tree.positions(4) == [4 + d for d in tree.depths] == [4, 5, 5, 6, 7, 6]


def test_subtree_keeps_structure_and_order():
    tree = example_tree()
    sub, kept = tree.subtree([0, 2, 5, 1])
    assert kept == [0, 1, 2, 5] and sub.tokens == [5, 7, 9, 2] and sub.parents == [-1, 0, 0, 2]


def test_subtree_numbers_depth_first_with_the_best_child_first():
    tree = example_tree()  # 0 -> 1 -> 3 -> 4 and 0 -> 2 -> 5
    sub, kept = tree.subtree(range(6))
    assert kept == [0, 1, 3, 4, 2, 5] and sub.parents == [-1, 0, 1, 2, 0, 4]
    scores = [1.0, 0.3, 0.6, 0.2, 0.1, 0.5]  # node 2's branch is the likelier
    sub, kept = tree.subtree([0, 1, 2, 3, 5], scores)
    assert kept == [0, 2, 5, 1, 3] and sub.tokens == [5, 9, 2, 7, 11] and sub.parents == [-1, 0, 1, 0, 3]
    assert sub.path(2) == [0, 1, 2]  # the likeliest path occupies the first slots: committing it moves nothing


def test_candidates_are_chosen_without_being_added_to_a_tree():
    tree = example_tree()  # candidates 6, 7, 8: leaves below nodes 4, 0 and 5, not added to the tree
    tokens, parents = tree.tokens + [21, 22, 23], tree.parents + [4, 0, 5]
    scores = [1.0, 0.3, 0.6, 0.2, 0.1, 0.5, 0.05, 0.7, 0.4]
    chosen, kept = Tree.chosen(tokens, parents, [8, 0, 2, 7, 5, 1], scores)
    assert kept == [0, 7, 2, 5, 8, 1]  # depth first, the likelier child first: 22 (0.7), then 9 (0.6) -> 2 -> 23, then 7
    assert chosen.tokens == [5, 22, 9, 2, 23, 7] and chosen.parents == [-1, 0, 0, 2, 3, 0]
    assert chosen.depths == [0, 1, 1, 2, 3, 1] and chosen.children == [[1, 2, 5], [], [3], [4], [], []]
    for node in range(len(chosen)):
        assert set(chosen.mask()[node].nonzero().flatten().tolist()) == set(chosen.path(node))


def drafters(models, sampling):
    draft = GPT2Engine.load(models["good"])
    table = SuccessorTable.load(models["ngram"] / "successors.npz")
    return {
        "tree": TreeDrafter(draft, budget=12, depth=4, branch=3),
        "tree-sampled": TreeDrafter(draft, budget=12, depth=4, branch=2, sampled=True),
        "staged": StagedDrafter(draft, table, budget=12, widths=[3, 2, 1], draft_children=2),
        "ngram": NgramDrafter(table, budget=12, widths=[3, 2, 1]),
        "lookup": LookupDrafter(length=4, branches=2),
        "staged-context": StagedDrafter(draft, table, budget=12, widths=[3, 2, 1], context=LookupDrafter(4, 2), depth=4),
        "staged-calls": StagedDrafter(draft, table, budget=12, widths=[2, 1], depth=6, draft_calls=4),
        "staged-shape": StagedShapeDrafter(draft, table, **SHAPE, widths=[2, 1], context=LookupDrafter(4, 2)),
    }


@pytest.mark.parametrize("draft", ["good", "bad"])
def test_greedy_tree_methods_equal_baseline(models, draft):
    oracle = GPT2Engine.load(models["oracle"])
    methods = drafters(models, Sampling())
    if draft == "bad":
        bad = GPT2Engine.load(models["bad"])
        table = SuccessorTable.load(models["ngram"] / "successors.npz")
        methods = {"tree": TreeDrafter(bad, budget=12, depth=4, branch=3),
                   "staged": StagedDrafter(bad, table, budget=12, widths=[3, 2, 1]),
                   "staged-context": StagedDrafter(bad, table, budget=12, widths=[3, 2, 1],
                                                   context=LookupDrafter(6, 2), depth=6),
                   "staged-calls": StagedDrafter(bad, table, budget=12, widths=[2, 1], depth=6, draft_calls=4,
                                                 context=LookupDrafter(6, 2)),
                   "staged-shape": StagedShapeDrafter(bad, table, **SHAPE, widths=[1, 1], context=LookupDrafter(6))}
    rng = torch.Generator().manual_seed(5)
    per_call = {name: [] for name in methods}
    for _ in range(12):
        prompt = torch.randint(0, 97, (int(torch.randint(1, 10, (), generator=rng)),), generator=rng)
        expected = baseline(oracle, prompt, 40, Sampling(), stop_ids={0}).tokens
        for name, drafter in methods.items():
            out = tree_speculative(oracle, prompt, 40, Sampling(), stop_ids={0}, drafter=drafter)
            assert out.tokens == expected, name
            per_call[name].append(len(out.tokens) / out.oracle_calls)
    if draft == "good":  # a good draft's trees are mostly accepted
        assert np.mean(per_call["tree"]) > 2.5 and np.mean(per_call["staged"]) > 2.0  # staged: at most 3 levels here


def test_sample_match_walks_the_path_that_carries_the_sampled_tokens():
    tree = example_tree()
    p = torch.zeros(6, 16)
    p[0, 7] = p[1, 11] = p[3, 13] = p[4, 1] = 1  # the oracle's point masses along 5 -> 7 -> 11 -> 13, then 1
    assert sample_match(tree, Target(p, Sampling()), None) == ([0, 1, 3, 4], 1)
    assert sample(p[4], Uniforms()) == 1


@pytest.mark.parametrize("kernels", [PortableKernels(), host_kernels()], ids=["portable", "decoding's"])
def test_continuations_of_a_repeated_pattern(kernels):
    tokens = [5, 6, 7, 8, 9, 1, 4, 6, 7]
    assert kernels.continuations(tokens, 3, 4) == [[8, 9, 1, 4]]  # the longest suffix seen before is (6, 7)
    tokens += [2, 6, 7]  # (6, 7) now also followed by 2: the latest occurrence first, then the earlier one
    assert kernels.continuations(tokens, 3, 3, branches=2) == [[2, 6, 7], [8, 9, 1]]
    assert kernels.continuations(tokens, 1, 2, branches=5) == [[2, 6], [8, 9]]  # (7) alone: two different ones
    assert kernels.continuations([1, 2, 3, 1, 2, 3], 3, 7) == [[1, 2, 3, 1, 2, 3, 1]]  # the period goes on
    assert kernels.continuations([4, 5, 6], 3, 3) == [] and kernels.continuations([4], 3, 3) == []  # nothing repeats
    drafter = LookupDrafter(length=3, branches=2)
    tree = drafter.propose(tokens, 2, Sampling(), None)  # capped at the depth left
    assert tree.tokens == [7, 2, 6, 8, 9] and tree.parents == [-1, 0, 1, 0, 3]


def test_staged_keeps_the_context_continuation_whatever_the_draft_thinks(models):
    bad = GPT2Engine.load(models["bad"])
    table = SuccessorTable.load(models["ngram"] / "successors.npz")
    staged = StagedDrafter(bad, table, budget=8, widths=[3, 2, 1], context=LookupDrafter(4), depth=4)
    staged.reset()
    tokens = [11, 12, 13, 14, 15, 16, 11, 12]
    tree = staged.propose(tokens, 10, Sampling(), None)
    chain = tree.path(next(n for n in range(len(tree)) if tree.depths[n] == 4 and tree.tokens[n] == 16))
    assert [tree.tokens[n] for n in chain] == [12, 13, 14, 15, 16] and len(tree) <= 8


def test_staged_draft_calls_carry_the_drafts_own_chain_to_the_depth_in_fewer_calls(models):
    """With more draft calls a step, the staged tree holds the chain that chain drafting proposes (the draft's
    argmax token after token) down to the depth; where the trigram guesses the draft's tokens, one call covers
    several of them."""
    oracle, draft = GPT2Engine.load(models["oracle"]), GPT2Engine.load(models["good"])
    table = SuccessorTable.load(models["ngram"] / "successors.npz")
    depth = 6
    chain, staged = ChainDrafter(draft, k=depth), StagedDrafter(draft, table, budget=64, widths=[2, 1, 1], depth=depth,
                                                                draft_calls=depth)
    one_call = StagedDrafter(draft, table, budget=64, widths=[2, 1, 1], depth=depth)
    calls, deepest = {"chain": 0, "staged": 0}, []
    rng = torch.Generator().manual_seed(3)
    for _ in range(10):
        prompt = torch.randint(0, 97, (5,), generator=rng)
        tokens = prompt.tolist() + baseline(oracle, prompt, 8, Sampling(), stop_ids=()).tokens
        for name, drafter in (("chain", chain), ("staged", staged)):
            drafter.reset()
            tree = drafter.propose(tokens, depth, Sampling(), None)
            calls[name] += drafter.calls
            if name == "chain":
                expected = tree.tokens
            else:
                node = 0
                for token in expected[1:]:  # the chain's tokens, one below the other
                    node = next(c for c in tree.children[node] if tree.tokens[c] == token)
                assert tree.depths[node] == depth
        one_call.reset()
        deepest.append(max(one_call.propose(tokens, depth, Sampling(), None).depths))
    assert calls["staged"] < calls["chain"] == 10 * depth
    assert min(deepest) < depth  # one call alone stops where the trigram leaves the draft's path


def test_best_first_keeps_the_earlier_of_tied_nodes():
    from decode import ranking

    scores = np.round(np.random.default_rng(0).random(400), 1).tolist()  # ties at every value
    expected = sorted(sorted(range(400), key=lambda n: (-scores[n], n))[:30])
    assert ranking.best_first(scores, 30) == expected
    assert ranking.best_first(scores, 500) == list(range(400))  # a budget past the candidates keeps them all
    assert ranking.best_first([1.0, 0.5, 0.5, 0.25], 3) == [0, 1, 2]


def test_trigram_trees_hold_each_levels_top_successors_and_are_remembered_unchanged(models):
    table = SuccessorTable.load(models["ngram"] / "successors.npz")
    trees = TrigramTrees(table, [3, 2, 1])
    tree, probs = trees([4, 9, 17], 10)
    assert len(tree) == 1 + 3 + 6 + 6 and len(probs) == len(tree) and probs[0] == 1.0
    for node in range(1, len(tree)):  # each node's children: the table's top successors of (grandparent, parent)
        parent = tree.parents[node]
        u = tree.tokens[tree.parents[parent]] if parent else 9
        top, top_probs = table.lookup(np.array([u]), np.array([tree.tokens[parent]]))
        rank = tree.children[parent].index(node)
        assert (tree.tokens[node], probs[node]) == (int(top[0, rank]), float(top_probs[0, rank]))
    tree.add(0, 5)  # the caller grows its copy
    again, _ = trees([1, 9, 17], 10)  # same last two tokens: the remembered tree, as built
    assert again.tokens == tree.tokens[:-1] and again.children[0] == tree.children[0][:-1]
    assert len(trees([9, 17], 2)[0]) == 1 + 3 + 6  # capped at the depth left


def test_path_products_of_a_trigram_tree_are_a_level_at_a_time_and_the_same(models):
    trees = TrigramTrees(SuccessorTable.load(models["ngram"] / "successors.npz"), [3, 2, 2])
    tree, probs = trees([4, 9, 17], 10)
    assert isinstance(trees.cumulative(probs, 3), np.ndarray) and list(trees.cumulative(probs, 3)) == tree.cumulative(probs)
    assert list(trees.cumulative(probs[:4], 1)) == tree.cumulative(probs)[:4]  # a shallower tree's


def test_ngram_selection_is_the_likeliest_nodes_remembered_per_context(models):
    table = SuccessorTable.load(models["ngram"] / "successors.npz")
    trees = TrigramTrees(table, [3, 2, 1])
    best = trees.best([4, 9, 17], 10, budget=5)
    tree, probs = trees([4, 9, 17], 10)
    cumulative = tree.cumulative(probs)
    top = sorted(range(len(tree)), key=lambda n: -cumulative[n])[:5]  # a child never beats its parent: ancestor-closed
    spelled = lambda t, nodes: sorted(tuple(t.tokens[n] for n in t.path(node)) for node in nodes)
    assert len(best) == 5 and spelled(best, range(5)) == spelled(tree, top)
    path, node = [tree.tokens[0]], 0  # the likeliest path: from the root, the chosen child of highest probability
    while chosen := [c for c in tree.children[node] if c in top]:
        node = max(chosen, key=lambda c: cumulative[c])
        path.append(tree.tokens[node])
    assert best.tokens[: len(path)] == path and best.parents[1 : len(path)] == list(range(len(path) - 1))
    assert trees.best([1, 9, 17], 10, budget=5) is best  # same last two tokens: the remembered selection
    trees.forget()
    assert not trees.built and trees.best([1, 9, 17], 10, budget=5) is not best
