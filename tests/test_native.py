"""The C++ kernels (decode/kernels/cpp.py over decode/native/step.cpp) against the portable ones they replace on a
CPU: the trigram's trees, the staged drafter's greedy selection, sample-match and (top-k) multi-draft rejection
verification, argmax tokens, top-k distributions and draws and the context's continuations are the same, node for
node, on random contexts, trees, logits and sequences, ties included; decoding takes them; and where they cannot be
built, decoding says so once and goes on with the portable ones."""
import os
import random
import shutil

import pytest
import torch

from decode import native
from decode.kernels import NativeKernels, PortableKernels, kernels_for
from decode.models.cached_lm import Shortlist
from decode.drafting import ChainDrafter, LookupDrafter, ShapedTreeDrafter, StagedDrafter, TrigramTrees
from decode import ranking
from decode.models import engine as engine_module
from decode.models.engine import GPT2Engine
from decode.loop import baseline, tree_speculative
from decode.sampling import Sampling, Sparse, Uniforms
from decode.tree import Tree
from decode.verify import Target
from decode_models import tiny_gpt2, tiny_trigram
from decode.models.successors import SuccessorTable

REFERENCE = PortableKernels()


def compiler_found() -> bool:
    return bool(shutil.which(os.environ.get("CXX", "c++")) and shutil.which("ninja"))


@pytest.fixture
def built() -> NativeKernels:
    if not compiler_found():
        pytest.skip("no C++ compiler or ninja here: decoding uses the portable kernels")
    if native.module() is None:
        pytest.fail("the C++ loops did not build here although a compiler and ninja were found (see the note above)")
    return NativeKernels()


def random_tree(rng: random.Random, n: int, vocab: int) -> Tree:
    """n nodes below random earlier nodes, siblings holding different tokens."""
    tree = Tree.rooted(rng.randrange(vocab))
    while len(tree) < n:
        parent = rng.randrange(len(tree))
        token = rng.randrange(vocab)
        if all(tree.tokens[c] != token for c in tree.children[parent]):
            tree.add(parent, token)
    return tree


def test_trigram_trees_equal_the_portable_ones(built, tmp_path):
    oracle = tiny_gpt2(tmp_path / "oracle", seed=0)
    table = SuccessorTable.load(tiny_trigram(tmp_path / "ngram", oracle) / "successors.npz")
    fast, slow = built.trigram_reader(table), REFERENCE.trigram_reader(table)
    rng = random.Random(0)
    seen = table.histories[rng.sample(range(table.histories.size), 50)]
    contexts = [(int(h) // (table.vocab_size + 2), int(h) % (table.vocab_size + 2)) for h in seen]  # trigram rows
    vocab = table.vocab_size
    contexts += [(rng.randrange(vocab), rng.randrange(vocab)) for _ in range(50)]  # mostly backoff rows
    contexts += [(table.bos, rng.randrange(vocab)) for _ in range(10)]  # the start of a text
    for u, v in contexts:
        for widths in ([], [4], [4, 3, 2, 1]):
            assert fast(u, v, widths) == slow(u, v, widths), (u, v, widths)
    assert TrigramTrees(table, [4, 3, 2, 1]).build(*contexts[0], 4) == fast(*contexts[0], [4, 3, 2, 1])  # what drafting reads


@pytest.mark.parametrize("seed", range(6))
def test_staged_selection_equals_the_portable_one_node_for_node(built, seed):
    rng = random.Random(seed)
    vocab = 40
    for case in range(40):
        n = rng.choice([1, 2, 6, 20, 60, 200])
        tree = random_tree(rng, n, vocab)
        shortlist = Shortlist(rng.sample(range(vocab), 24), vocab) if case % 2 else None
        columns = len(shortlist) if shortlist else vocab
        if n <= 128 and case % 3 == 0:  # small integers: ties everywhere, broken alike (the earlier column, node)
            logits = torch.randint(-3, 3, (n, columns)).float()
        else:
            logits = torch.randn(n, columns) * 3
        copied = set(tree.path(rng.randrange(n))) - {0} if case % 4 == 1 else set()  # a continuation, as grafted
        order = [0] + sorted(copied) + [node for node in range(1, n) if node not in copied]
        max_depth, budget = rng.randint(1, 5), rng.choice([2, 5, 12, 36, 400])
        selection = (tree, logits, order, copied, max_depth, budget, 1, Sampling(), shortlist)
        expected, expected_kept = REFERENCE.staged_selection(*selection)
        chosen, kept = built.staged_selection(*selection)
        assert (chosen.tokens, chosen.parents, kept) == (expected.tokens, expected.parents, expected_kept), (seed, case)


@pytest.mark.parametrize("seed", range(4))
def test_greedy_walk_equals_sample_match(built, seed):
    rng = random.Random(seed)
    walked = []
    for case in range(60):
        tree = random_tree(rng, rng.choice([1, 3, 12, 40]), 10)
        logits = torch.randint(0, 4, (len(tree), 10)).float()  # ties: the first column wins
        for node, children in enumerate(tree.children):  # most rows point at a child, so walks go deep
            if children and rng.random() < 0.8:
                logits[node, tree.tokens[rng.choice(children)]] = 9
        path, following = built.sample_match(tree, Target(logits, Sampling()), None)
        assert (path, following) == REFERENCE.sample_match(tree, Target(logits, Sampling()), None), (seed, case)
        walked.append(len(path))
    assert max(walked) >= 4


def test_top_tokens_equal_the_portable_ranking(built):
    torch.manual_seed(0)
    for columns in (1, 7, 64, 65, 4096, 8192):
        shortlist = Shortlist(random.Random(columns).sample(range(2 * columns), columns), 2 * columns)
        ties = torch.randint(-2, 3, (5, columns)).float()  # ties: the first column wins
        ties[2, -1] = 9  # the largest in the last column
        distinct = torch.randn(6, columns)  # k > 1: torch's top-k orders ties as it likes
        distinct[1, -3:] = torch.tensor([7.0, 8.0, 9.0])[-columns:]  # the best in the last block, the order reversed
        for tokens_of in (None, shortlist):
            assert built.top_tokens(ties, 1, tokens_of) == REFERENCE.top_tokens(ties, 1, tokens_of), columns
            for k in sorted({k for k in (1, 2, 4, 9, columns if columns < 100 else 1) if k <= columns}):
                assert built.top_tokens(distinct, k, tokens_of) == REFERENCE.top_tokens(distinct, k, tokens_of), (columns, k)
    with pytest.raises(ValueError, match="k must be"):
        built.top_tokens(torch.zeros(2, 7), 8)


def test_the_cpp_kernels_check_what_they_are_handed(built):
    """Logits the C++ loops cannot read are refused at the boundary with what they are, never read as raw memory."""
    for wrong in (torch.zeros(4, 6, dtype=torch.bfloat16), torch.zeros(6, 4).T, torch.zeros(3, 4, 5), torch.zeros(5)):
        with pytest.raises(ValueError, match="contiguous float32 rows in CPU memory"):
            built.top_tokens(wrong, 1)
        with pytest.raises(ValueError, match="contiguous float32 rows in CPU memory"):
            built.sample_match(Tree.rooted(0), Target(wrong, Sampling()), None)


def test_top_k_distributions_equal_the_portable_ones(built):
    """Top-k distributions in C++ against the portable code (the processed distribution over the vocabulary): the
    same support, likeliest first, the same probabilities up to float32 rounding, ties at the k-th value kept (the
    bfloat16 logits tie often) and -inf logits left out."""
    torch.manual_seed(0)
    logits = (torch.randn(6, 4096) * 3).bfloat16().float()
    logits[0, :12] = logits[0].max() + 1  # twelve tied best tokens: a top-k below 12 keeps them all
    logits[1, 5:] = float("-inf")  # five tokens left: the support of any top-k
    shortlist = Shortlist(random.Random(0).sample(range(9000), 4096), 9000)
    rows = [5, 0, 1, 3]
    for sampling in (Sampling(1.0, top_k=50), Sampling(0.7, top_k=8), Sampling(1.3, top_k=100, top_p=0.9),
                     Sampling(2.0, top_k=1), Sampling(1.0, top_k=256, top_p=0.5)):
        for tokens_of in (None, shortlist):
            fast = built.distributions(logits, rows, sampling, tokens_of)
            slow = REFERENCE.distributions(logits, rows, sampling, tokens_of)
            for row, a, b in zip(rows, fast, slow):
                values = list(a.values())
                assert values == sorted(values, reverse=True) and sum(values) == pytest.approx(1), (sampling, row)
                if sampling.top_p == 1.0:  # top-p may cut between tied tokens, as torch's sort orders them
                    assert set(a) == set(b), (sampling, row)
                assert sorted(values) == pytest.approx(sorted(b.values()), rel=1e-5, abs=1e-7), (sampling, row)
            if sampling.top_p == 1.0:
                assert len(fast[2]) == min(sampling.top_k, 5)  # the -inf logits left out
                assert len(fast[1]) == 12 if sampling.top_k <= 12 else len(fast[1]) >= sampling.top_k  # ties kept
    odd = (torch.randn(3, 1001) * 2).bfloat16().float()  # a last block of 9 columns; its best value the row's
    odd[:, -1] = odd.max() + 1
    for sampling in (Sampling(1.0, top_k=8), Sampling(1.0, top_k=50)):
        fast, slow = built.distributions(odd, [0, 1, 2], sampling), REFERENCE.distributions(odd, [0, 1, 2], sampling)
        assert [list(a) for a in fast] == [list(b) for b in slow]
        assert [list(a.values()) for a in fast] == [pytest.approx(list(b.values()), rel=1e-5) for b in slow]
    with pytest.raises(ValueError, match="must be positive"):
        built.distributions(logits, [0], Sampling(0.0, top_k=5))
    with pytest.raises(ValueError, match="outside the logits"):
        built.distributions(logits, [6], Sampling(1.0, top_k=5))


def drawn_tree(rng: random.Random, draft: torch.Tensor, sampling: Sampling, generator: Uniforms) -> Tree:
    """A tree whose children at a node are independent draws from the draft's q after it (row i of `draft`: after node
    i), as the sampled drafters grow theirs, while it has fewer nodes than `draft` rows."""
    tree = Tree.rooted(0)
    for node in range(len(draft)):
        if node >= len(tree):
            break
        count = min(rng.choice([0, 1, 1, 2, 3]), len(draft) - len(tree))
        if count:
            [tokens], [q] = ranking.draw_children(REFERENCE, sampling, draft, count, generator, rows=[node])
            tree.child_dists[node] = q
            for token in tokens:
                tree.add(node, token)
    return tree


@pytest.mark.parametrize("seed", range(3))
def test_draws_equal_the_portable_draws(built, seed):
    """draw_children under a top-k setting, in one C++ call: the same tokens and distributions as drawing from
    the distributions one by one (`Sparse.draw`), with the same uniform draws."""
    torch.manual_seed(seed)
    logits = (torch.randn(5, 2048) * 3).bfloat16().float()
    shortlist = Shortlist(random.Random(seed).sample(range(3000), 2048), 3000)
    for sampling in (Sampling(1.0, top_k=50), Sampling(0.7, top_k=8, top_p=0.8), Sampling(1.5, top_k=1)):
        for tokens_of in (None, shortlist):
            fast, slow = Uniforms(torch.Generator().manual_seed(seed)), Uniforms(torch.Generator().manual_seed(seed))
            drawn, qs = ranking.draw_children(built, sampling, logits, 3, fast, tokens_of, rows=[4, 0, 2])
            expected = built.distributions(logits, [4, 0, 2], sampling, tokens_of)
            assert qs == expected and all(isinstance(q, Sparse) for q in qs), sampling
            assert drawn == [[q.draw(u) for u in slow.take(3)] for q in expected], sampling
            assert fast.take(1) == slow.take(1)  # as many draws read
    with pytest.raises(ValueError, match="count draws per listed row"):
        built.draws(logits, [0, 1], 2, Sampling(1.0, top_k=5), None, [0.5] * 3)


@pytest.mark.parametrize("seed", range(4))
def test_rejection_walk_equals_multi_draft_rejection(built, monkeypatch, seed):
    """Multi-draft rejection under a top-k setting in one C++ call against the portable rule, given the same oracle
    distributions: the same path, the same following token, and the same number of uniform draws read, on trees of
    one to three draws a node whose walks accept, reject and resample."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    depths, rejected = [], 0
    for case in range(80):
        sampling = rng.choice([Sampling(1.0, top_k=20), Sampling(0.8, top_k=6), Sampling(1.2, top_k=40, top_p=0.9)])
        draft = (torch.randn(16, 300) * 2).bfloat16().float()
        oracle = (draft + torch.randn(16, 300) * rng.choice([0.3, 1.0])).bfloat16().float()
        tree = drawn_tree(rng, draft, sampling, Uniforms(torch.Generator().manual_seed(case)))
        fast, slow = Uniforms(torch.Generator().manual_seed(case)), Uniforms(torch.Generator().manual_seed(case))
        path, following = built.multi_draft_rejection(tree, Target(oracle, sampling), fast)
        with monkeypatch.context() as same_p:  # the portable walk over the same p, read in C++
            same_p.setattr(Target, "probs", lambda target, node: built.distributions(target.logits, [node],
                                                                                     target.sampling)[0])
            assert (path, following) == REFERENCE.multi_draft_rejection(tree, Target(oracle, sampling), slow), (seed, case)
        assert fast.take(1) == slow.take(1), (seed, case)
        depths.append(len(path))
        rejected += bool(tree.children[path[-1]])
    assert max(depths) >= 3 and rejected >= 10  # deep walks, and walks that ended in a resample


@pytest.mark.parametrize("seed", range(3))
def test_continuations_equal_the_portable_ones_as_the_sequence_grows(built, seed):
    rng = random.Random(seed)
    found = set()
    for case in range(12):
        period, max_ngram = rng.randrange(1, 9), rng.choice([1, 2, 3, 4])
        tokens = [rng.randrange(6) for _ in range(period)]
        while len(tokens) < 100:  # a few tokens: repeats of every order, and periods running into the end
            tokens.append(tokens[-period] if rng.random() < 0.7 else rng.randrange(6))
            length, branches = rng.choice([1, 3, 10]), rng.choice([1, 2, 4])
            expected = REFERENCE.continuations(tokens, max_ngram, length, branches)
            assert built.continuations(tokens, max_ngram, length, branches) == expected, (seed, case, len(tokens))
            found.add(len(expected))
    assert found == {0, 1, 2, 3, 4}  # none, and up to four different continuations


class Counted:
    """The C++ module, counting the calls of the named loops."""

    def __init__(self, module, names):
        self.module, self.calls = module, dict.fromkeys(names, 0)

    def __getattr__(self, name):
        inner = getattr(self.module, name)
        if name not in self.calls:
            return inner

        def counted(*args):
            self.calls[name] += 1
            return inner(*args)

        return counted


def test_greedy_decoding_takes_the_cpp_loops_and_equals_the_baseline(built, monkeypatch, tmp_path):
    oracle_dir = tiny_gpt2(tmp_path / "oracle", seed=0)
    oracle = GPT2Engine.load(oracle_dir)
    draft = GPT2Engine.load(tiny_gpt2(tmp_path / "draft", seed=1, noise_from=oracle_dir, noise=0.005))
    table = SuccessorTable.load(tiny_trigram(tmp_path / "ngram", oracle_dir) / "successors.npz")
    counted = Counted(native.module(), ["staged_selection", "greedy_walk", "top_tokens", "continuations", "trigram_tree"])
    monkeypatch.setattr(native, "module", lambda: counted)
    assert isinstance(kernels_for(oracle.device), NativeKernels)
    staged = StagedDrafter(draft, table, budget=12, widths=[3, 2, 1], context=LookupDrafter())
    for prompt in ([4, 9, 17], [11, 12, 13, 14, 11, 12]):
        prompt = torch.tensor(prompt)
        expected = baseline(oracle, prompt, 32, Sampling(), eos_id=0).tokens
        out = tree_speculative(oracle, prompt, 32, Sampling(), eos_id=0, drafter=staged)
        assert out.tokens == expected
    assert all(counted.calls.values()), counted.calls  # top_tokens: the baseline's argmax


def needs_cpp_forward(dtype: str) -> None:
    """Skip unless this CPU runs the C++ forward of a model in `dtype`; fail where it should and did not build."""
    if native.forward_module(getattr(torch, dtype)) is None:
        if native.forward_build(getattr(torch, dtype)) is not None:
            pytest.fail(f"the C++ forward did not build on a CPU that runs its {native.forward_build(getattr(torch, dtype))} "
                        f"build (see the note above)")
        pytest.skip("this CPU has neither AVX2 with FMA nor AVX-512: the models' forwards run in torch")


@pytest.fixture
def blocks_here(built):
    needs_cpp_forward("bfloat16")
    return native.forward_module(torch.bfloat16)


@pytest.mark.parametrize("n_embd, n_head, shortlist", [  # heads of 8 (float32 attention) and of 32 (BF16); output
    (32, 4, None), (64, 2, None), (32, 4, 40),  # layers of 97 columns and of a shortlist's 40: neither a multiple of 16
    (256, 4, None)])  # products large enough to be split among threads
@pytest.mark.parametrize("dtype, tiles", [("bfloat16", False), ("bfloat16", True), ("float32", False)])
def test_a_models_blocks_in_cpp_equal_torchs_up_to_rounding(built, monkeypatch, tmp_path, n_embd, n_head, shortlist,
                                                            dtype, tiles):
    needs_cpp_forward(dtype)
    directory = tiny_gpt2(tmp_path / "draft", seed=2, n_embd=n_embd, n_head=n_head)
    shortlist = shortlist and Shortlist(random.Random(1).sample(range(97), shortlist), 97)
    in_torch, in_cpp = (GPT2Engine.load(directory, dtype, native_blocks=cpp, shortlist=shortlist)
                        for cpp in (False, True))
    if tiles and not in_cpp.blocks.can_tile:
        pytest.skip("no AMX-BF16 here (or the model is not one the tiles take): the products run as vector dot products")
    if dtype == "float32":  # the reference for float32 roundings is the same model in float64
        monkeypatch.setitem(engine_module.DTYPES, "float64", torch.float64)
    exact = GPT2Engine.load(directory, "float32" if dtype == "bfloat16" else "float64", shortlist=shortlist)
    assert in_torch.blocks is None and in_cpp.blocks is not None
    in_cpp.blocks.tiles = tiles
    assert in_cpp.blocks.tiles == tiles
    rows = []
    inner = in_cpp.blocks.__call__
    monkeypatch.setattr(in_cpp, "blocks", lambda *args: rows.append(len(args[0])) or inner(*args))
    rng = random.Random(0)
    tree = random_tree(rng, 15, 97)
    forwards = [  # a prompt past the C++ call's rows (torch's), one within them, a tree under a mask, a chain after
        # the commit, one node
        lambda m: m.extend(torch.tensor([rng.randrange(97) for _ in range(native.Blocks.ROWS + 8)]), last=5),
        lambda m: m.extend(torch.tensor([rng.randrange(97) for _ in range(20)]), last=5),
        lambda m: m.forward(tree.tokens, tree.positions(m.length), tree.mask()),
        lambda m: (m.commit(tree.path(len(tree) - 1)), m.forward(torch.tensor([3, 4, 5]), torch.arange(3) + m.length, None))[1],
        lambda m: m.forward(torch.tensor([6]), torch.tensor([m.length + m.pending]), None),
    ]
    agree = []
    for forward in forwards:
        state = rng.getstate()
        expected = forward(in_torch)
        rng.setstate(state)  # the same random prompt for each
        reference = forward(exact)
        rng.setstate(state)
        got = forward(in_cpp)
        assert got.shape == expected.shape and got.dtype == torch.float32
        # the C++ strays from the reference about as far as torch does in the same dtype (bfloat16 rounds at 2^-8
        # relative, float32 at 2^-24)
        slack = 0.01 if dtype == "bfloat16" else 1e-5
        assert (got - reference).abs().max() <= 2 * (expected - reference).abs().max() + slack * reference.abs().max()
        agree += (got.argmax(-1) == expected.argmax(-1)).tolist()
        slots = in_torch.length + in_torch.pending
        assert in_cpp.length + in_cpp.pending == slots
        cached, exact_cache = (m.kv_cache[..., :slots, :].float() for m in (in_torch, exact))
        assert ((in_cpp.kv_cache[..., :slots, :].float() - exact_cache).abs().max()
                <= 2 * (cached - exact_cache).abs().max() + slack * exact_cache.abs().max())
    assert sum(agree) >= (0.9 if dtype == "bfloat16" else 1.0) * len(agree)
    assert rows == [20, 15, 3, 1]  # every forward but the long prompt's took the C++ call
    with pytest.raises(IndexError, match="out of range"):  # as torch's embedding refuses them, not a read past wte
        in_cpp.forward(torch.tensor([97]), torch.tensor([in_cpp.length]), None)


DTYPES_AND_PRODUCTS = [("bfloat16", False), ("bfloat16", True), ("float32", False)]
# an oracle's and a draft's shape: heads of 32 (the vector attention) and of 8 (part of a vector, or one by one)
SHAPES = [(64, 2), (32, 4)]


def engine_in_cpp(directory, dtype: str, tiles: bool) -> GPT2Engine:
    needs_cpp_forward(dtype)
    engine = GPT2Engine.load(directory, dtype, native_blocks=True)
    if tiles and not engine.blocks.can_tile:
        pytest.skip("no AMX-BF16 here: the products run as vector dot products")
    engine.blocks.tiles = tiles
    return engine


@pytest.mark.parametrize("dtype, tiles", DTYPES_AND_PRODUCTS)
@pytest.mark.parametrize("n_embd, n_head", SHAPES)
def test_a_rows_logits_in_cpp_do_not_depend_on_the_forwards_other_rows(built, tmp_path, dtype, tiles, n_embd, n_head):
    # what keeps a greedy speculative decoding's tokens those of one token a forward, bit for bit
    engine = engine_in_cpp(tiny_gpt2(tmp_path / "model", seed=3, n_embd=n_embd, n_head=n_head), dtype, tiles)
    engine.extend(torch.tensor([5, 6, 7, 8]))
    chain = [9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26]  # more rows than a tile holds
    together = engine.forward(chain, list(range(engine.length, engine.length + len(chain))), None)
    engine.commit([])
    for i, token in enumerate(chain):
        alone = engine.forward([token], [engine.length], None)
        engine.commit([0])
        assert torch.equal(alone[0], together[i])


@pytest.mark.parametrize("dtype, tiles", DTYPES_AND_PRODUCTS)
@pytest.mark.parametrize("n_embd, n_head", SHAPES)
def test_a_rows_logits_in_cpp_are_the_same_bits_alone_and_anywhere_in_a_call_of_2_to_64_rows(built, tmp_path, dtype,
                                                                                            tiles, n_embd, n_head):
    engine = engine_in_cpp(tiny_gpt2(tmp_path / "model", seed=3, n_embd=n_embd, n_head=n_head), dtype, tiles)
    engine.extend(torch.tensor([5, 6, 7, 8, 40, 41, 42]))
    alone = engine.forward([9], [engine.length], None)[0]
    engine.commit([])
    rng = random.Random(0)
    for q in (2, 3, 5, 8, 13, 16, 17, 33, 64):
        for at in sorted({0, q // 2, q - 1}):
            tokens = [rng.randrange(97) for _ in range(q)]
            tokens[at] = 9
            # siblings below the cache: each row sees the cached tokens and itself, as the lone row did
            logits = engine.forward(tokens, [engine.length] * q, torch.eye(q, dtype=torch.bool))
            engine.commit([])
            assert torch.equal(logits[at], alone), f"row {at} of {q}"


def test_the_near_tie_checker_replays_a_cpp_forward_in_torch_too(blocks_here, tmp_path):
    from decode.cli import near_ties

    engine = GPT2Engine.load(tiny_gpt2(tmp_path / "model", seed=3, n_embd=64, n_head=2), "bfloat16",
                             native_blocks=True)
    context = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]
    rows = near_ties.replayed_logits(engine, context, 3)
    engine.native_rows, native_rows = 0, engine.native_rows
    in_torch = near_ties.replayed_logits(engine, context, 3)
    engine.native_rows = native_rows
    half = len(in_torch)
    assert len(rows) == 2 * half and torch.equal(rows[half:], in_torch)
    assert (rows[:half] == rows[0]).all()  # the C++ replays agree to the bit, the cache written in chunks of any size


def test_decoding_with_a_drafts_blocks_in_cpp_equals_the_baseline(blocks_here, monkeypatch, tmp_path):
    oracle_dir = tiny_gpt2(tmp_path / "oracle", seed=0)
    oracle = GPT2Engine.load(oracle_dir)
    draft = GPT2Engine.load(tiny_gpt2(tmp_path / "draft", seed=1, noise_from=oracle_dir, noise=0.005), "bfloat16",
                            native_blocks=True)
    table = SuccessorTable.load(tiny_trigram(tmp_path / "ngram", oracle_dir) / "successors.npz")
    calls = []
    inner = draft.blocks.__call__
    monkeypatch.setattr(draft, "blocks", lambda *args: calls.append(len(args[0])) or inner(*args))
    staged = StagedDrafter(draft, table, budget=12, widths=[3, 2, 1], context=LookupDrafter())
    for prompt in ([4, 9, 17], [11, 12, 13, 14, 11, 12]):
        prompt = torch.tensor(prompt)
        out = tree_speculative(oracle, prompt, 32, Sampling(), eos_id=0, drafter=staged)
        assert out.tokens == baseline(oracle, prompt, 32, Sampling(), eos_id=0).tokens
        assert out.oracle_calls < len(out.tokens)  # the draft's proposals were accepted
    assert len(calls) > 4 and max(calls) > 1


@pytest.mark.parametrize("sampling", [Sampling(), Sampling(1.0, 5), Sampling(0.8, 12, 0.9)],
                         ids=["greedy", "top-k", "top-k top-p"])
@pytest.mark.parametrize("shortlist", [None, 40])
def test_a_chain_drafted_in_one_cpp_call_equals_the_chain_drafted_a_forward_at_a_time(blocks_here, monkeypatch, tmp_path,
                                                                                       sampling, shortlist):
    """A chain drafter (and a planned shape that is a chain) makes a step's draft forwards and the tokens they choose
    in one C++ call where the draft runs in C++: the same trees, the same q at every node and the same output, step
    after step, as one draft forward a node."""
    oracle_dir = tiny_gpt2(tmp_path / "oracle", seed=0)
    oracle = GPT2Engine.load(oracle_dir)
    shortlist = shortlist and Shortlist(random.Random(1).sample(range(97), shortlist), 97)
    draft = GPT2Engine.load(tiny_gpt2(tmp_path / "draft", seed=1, noise_from=oracle_dir, noise=0.02), "bfloat16",
                            native_blocks=True, shortlist=shortlist)
    inner, fits = draft.chain, draft.chains
    for drafter in (ChainDrafter(draft, 4), ShapedTreeDrafter(draft, [-1, 0, 1, 2, 3], [0] * 5, sampled=True)):
        made, calls = {}, {}
        propose = drafter.propose
        for one_call in (True, False):
            made[one_call], calls[one_call] = [], []
            monkeypatch.setattr(draft, "chains", lambda rows, setting: one_call and fits(rows, setting))
            monkeypatch.setattr(draft, "chain", lambda *args, seen=calls[one_call]: seen.append(args) or inner(*args))
            monkeypatch.setattr(drafter, "propose", lambda *args, seen=made[one_call]: seen.append(propose(*args)) or seen[-1])
            for seed, prompt in enumerate(([4, 9, 17], [11, 12, 13, 14, 11, 12] * 3)):
                out = tree_speculative(oracle, torch.tensor(prompt), 40, sampling, eos_id=None, drafter=drafter,
                                       generator=torch.Generator().manual_seed(seed))
                made[one_call].append(out.tokens)
        drafted = sum(isinstance(t, Tree) and len(t) > 1 for t in made[True])
        assert len(calls[True]) == drafted and not calls[False]  # every proposal in one call, or none in any
        assert [(t.tokens, t.parents, t.child_dists) if isinstance(t, Tree) else t for t in made[True]] == \
               [(t.tokens, t.parents, t.child_dists) if isinstance(t, Tree) else t for t in made[False]]


def test_without_a_compiler_decoding_says_so_once_and_goes_on_with_the_portable_kernels(monkeypatch, caplog):
    from torch.utils import cpp_extension

    def no_compiler(*args, **kwargs):
        raise RuntimeError("Ninja is required to load C++ extensions")

    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    native.module.cache_clear()
    try:
        assert native.module() is None and native.module() is None
        assert caplog.text.count("note: the decoding step's C++ loops could not be built (Ninja is required") == 1
        assert isinstance(kernels_for("cpu"), PortableKernels) and not isinstance(kernels_for("cpu"), NativeKernels)
        monkeypatch.setenv("STAGED_SPECULATIVE_NATIVE", "0")
        native.module.cache_clear()
        caplog.clear()
        assert native.module() is None and not caplog.text  # turned off: nothing to say
    finally:
        native.module.cache_clear()


def test_a_forward_runs_in_cpp_up_to_the_rows_measured_faster_there_and_the_choice_is_kept(blocks_here, monkeypatch,
                                                                                          tmp_path):
    from decode.models import native_rows

    directory = tiny_gpt2(tmp_path / "model", seed=2)
    engine = GPT2Engine.load(directory, "bfloat16", native_blocks=True)
    monkeypatch.setattr(native.Blocks, "can_tile", True)  # both ways of the products timed, on any CPU
    timed, tiles_win = [], True

    def forward_costs(model, repeats, counts):  # C++ faster up to 8 rows, and again at 32: the first crossing counts
        # (one row slowed by other work in the first round only); the tiles' products faster but at one row, or slower
        timed.append((model.native_rows, model.blocks.tiles))
        if not model.native_rows:
            return {q: 2.0 for q in counts}
        if model.blocks.tiles:
            return {q: (1.2 if q == 1 else 0.5 if tiles_win else 1.9) for q in counts}
        burst = timed.count(timed[-1]) == 1
        return {q: (9.0 if q == 1 and burst else 1.0 if q <= 8 or q == 32 else 3.0) for q in counts}

    monkeypatch.setattr(native_rows, "forward_costs", forward_costs)
    uncalibrated = native_rows.native_forward(directory, engine, "bfloat16", tmp_path / "cache")
    assert uncalibrated == native_rows.NativeForward(native.Blocks.ROWS, False) and not timed  # the default, untimed
    for calibrate in (True, False):  # measured and kept, then read back
        assert native_rows.native_forward(directory, engine, "bfloat16", tmp_path / "cache", calibrate=calibrate) == (
            native_rows.NativeForward(64, True))
    rows = max(native_rows.ROW_COUNTS)
    # timed every way in turn, native_rows.ROUNDS times, then read back
    assert timed == [(rows, False), (rows, True), (0, engine.blocks.tiles)] * native_rows.ROUNDS
    tiles_win = False
    timed.clear()
    assert native_rows.native_forward(directory, engine, "bfloat16", tmp_path / "other", calibrate=True) == (
        native_rows.NativeForward(8, False))
    assert native_rows.native_forward(directory, GPT2Engine.load(directory, "float32"), "float32") == (
        native_rows.NativeForward(0, False))  # no C++ forward

    engine.native_rows, rows = 8, []
    inner = engine.blocks.__call__
    monkeypatch.setattr(engine, "blocks", lambda *args: rows.append(len(args[0])) or inner(*args))
    engine.extend(torch.tensor([5, 6, 7, 8, 9, 10, 11, 12, 13]))
    for q in (8, 1):
        engine.forward(torch.arange(q), torch.arange(q) + engine.length, None)
        engine.commit([])
    assert rows == [8, 1]  # the nine-row prompt ran in torch
