"""The C++ kernels (decode/kernels/cpp.py over decode/native/step.cpp) against the portable ones they replace on a
CPU: the trigram's trees, the staged drafter's greedy selection, sample-match and (top-k) multi-draft rejection
verification, argmax tokens, top-k distributions and draws and the context's continuations are the same, node for
node, on random contexts, trees, logits and sequences, ties included; decoding takes them; and where they cannot be
built, decoding says so once and goes on with the portable ones."""
import os
import random
import time

import numpy as np
import pytest
import torch
from decode_models import tiny_gpt2, tiny_trigram
from native_built import random_tree

from decode import native, ranking
from decode.drafting import LookupDrafter, StagedDrafter, TrigramTrees
from decode.kernels import NativeKernels, PortableKernels
from decode.loop import baseline, tree_speculative
from decode.models.engine import GPT2Engine
from decode.models.runtime import host_kernels, runtime_for
from decode.models.successors import SuccessorTable
from decode.sampling import Sampling, Sparse, Uniforms
from decode.shortlist import Shortlist
from decode.tree import Tree
from decode.verify import Target

REFERENCE = PortableKernels()


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
        with pytest.raises(TypeError, match="logits must be contiguous float32 rows in CPU memory"):
            built.top_tokens(wrong, 1)
        with pytest.raises(TypeError, match="logits must be contiguous float32 rows in CPU memory"):
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

        def counted(*args, **kwargs):
            self.calls[name] += 1
            return inner(*args, **kwargs)

        return counted


def test_greedy_decoding_takes_the_cpp_loops_and_equals_the_baseline(built, monkeypatch, tmp_path, request):
    counted = Counted(native.module(), ["staged_selection", "greedy_walk", "top_tokens", "continuations", "trigram_tree"])
    monkeypatch.setattr(native, "module", lambda: counted)
    host_kernels.cache_clear()  # made again over the counted module, and again after the test
    request.addfinalizer(host_kernels.cache_clear)
    oracle_dir = tiny_gpt2(tmp_path / "oracle", seed=0)
    oracle = GPT2Engine.load(oracle_dir)
    draft = GPT2Engine.load(tiny_gpt2(tmp_path / "draft", seed=1, noise_from=oracle_dir, noise=0.005))
    table = SuccessorTable.load(tiny_trigram(tmp_path / "ngram", oracle_dir) / "successors.npz")
    assert isinstance(oracle.runtime.kernels, NativeKernels)
    staged = StagedDrafter(draft, table, budget=12, widths=[3, 2, 1], context=LookupDrafter())
    for prompt in ([4, 9, 17], [11, 12, 13, 14, 11, 12]):
        prompt = torch.tensor(prompt)
        expected = baseline(oracle, prompt, 32, Sampling(), stop_ids={0}).tokens
        out = tree_speculative(oracle, prompt, 32, Sampling(), stop_ids={0}, drafter=staged)
        assert out.tokens == expected
    assert all(counted.calls.values()), counted.calls  # top_tokens: the baseline's argmax


def test_without_a_compiler_decoding_says_so_once_and_goes_on_with_the_portable_kernels(monkeypatch, caplog):
    from torch.utils import cpp_extension

    def no_compiler(*args, **kwargs):
        raise RuntimeError("Ninja is required to load C++ extensions")

    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    native.module.cache_clear()
    try:
        assert native.module() is None and native.module() is None
        assert caplog.text.count("note: the decoding step's C++ loops could not be built (Ninja is required") == 1
        host_kernels.cache_clear()
        kernels = runtime_for("cpu").kernels, host_kernels()
        assert all(isinstance(k, PortableKernels) and not isinstance(k, NativeKernels) for k in kernels)
        monkeypatch.setenv("STAGED_SPECULATIVE_NATIVE", "0")
        native.module.cache_clear()
        caplog.clear()
        assert native.module() is None and not caplog.text  # turned off: nothing to say
    finally:
        native.module.cache_clear()
        host_kernels.cache_clear()


def test_the_cpp_loops_take_named_arguments_and_check_the_arrays_they_read(built, tmp_path):
    """Each entry point takes its arguments by name, and checks an array's element type, dimensions and contiguity
    before reading it: a wrong array is a TypeError, never a read of the wrong bytes."""
    module, logits = built.module, torch.randn(3, 8, generator=torch.Generator().manual_seed(0))
    assert module.top_tokens(logits=logits.numpy(), k=2, shortlist_tokens=None) == REFERENCE.top_tokens(logits, 2)
    with pytest.raises(TypeError, match="by name"):
        module.top_tokens(logits.numpy(), 2, None)
    with pytest.raises(TypeError, match="shortlist_tokens is missing"):
        module.top_tokens(logits=logits.numpy(), k=2)
    with pytest.raises(TypeError, match="unexpected or repeated argument row"):
        module.top_tokens(logits=logits.numpy(), k=2, shortlist_tokens=None, row=0)
    wrong = {"float64": logits.double().numpy(), "one row": logits[0].numpy(), "transposed": logits.T.numpy()}
    for array in wrong.values():
        with pytest.raises(TypeError, match="logits must be contiguous float32 rows"):
            module.top_tokens(logits=array, k=2, shortlist_tokens=None)
    with pytest.raises(TypeError, match="shortlist tokens must be"):  # int32 where the shortlist is int64
        module.top_tokens(logits=logits.numpy(), k=2, shortlist_tokens=np.arange(8, dtype=np.int32))
    table = SuccessorTable.load(tiny_trigram(tmp_path / "ngram", tiny_gpt2(tmp_path / "oracle", seed=0)) / "successors.npz")
    read = built.trigram_reader(table)
    assert read(5, 7, [2, 1]) == REFERENCE.trigram_reader(table)(5, 7, [2, 1])
    with pytest.raises(TypeError, match="histories must be"):
        module.trigram_tree(histories=table.histories.astype(np.int32), successors=table.successors,
                            vocab_size=table.vocab_size, before_root=5, root=7, widths=[1])
    with pytest.raises(ValueError, match="a width past the table's successors"):
        read(5, 7, [table.k + 1])


def test_a_build_lock_left_by_a_killed_build_is_removed_and_a_fresh_one_kept(tmp_path, monkeypatch, caplog):
    from torch.utils import cpp_extension

    built = []
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(cpp_extension, "load", lambda name, *args, **kwargs: built.append(name) or name)
    name = native.build(native.SOURCE)  # the name torch's builder would lock under
    stale, fresh = tmp_path / "py3_cpu" / name / "lock", tmp_path / name / "lock"
    for lock in (stale, fresh):
        lock.parent.mkdir(parents=True)
        lock.touch()
    old = time.time() - native.STALE_LOCK_SECONDS - 60
    os.utime(stale, (old, old))
    with caplog.at_level("WARNING", logger="decode.native"):
        native.build(native.SOURCE)
    assert not stale.exists() and fresh.exists() and built == [name, name]  # a build may still hold the fresh one
    assert f"removing {stale}" in caplog.text


def test_the_same_source_in_two_clones_builds_under_two_names(tmp_path, monkeypatch):
    """torch's builder rebuilds a module whose sources' paths change, so two clones sharing one name would rebuild
    each other's at every start: the name carries the source's folder as well as its content and flags."""
    from torch.utils import cpp_extension

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "built"))
    monkeypatch.setattr(cpp_extension, "load", lambda name, *args, **kwargs: name)
    copies = []
    for clone in ("a", "b"):
        (tmp_path / clone).mkdir()
        for path in (native.SOURCE, *native.SOURCE.parent.glob("*.h")):
            (tmp_path / clone / path.name).write_bytes(path.read_bytes())
        copies.append(tmp_path / clone / native.SOURCE.name)
    names = [native.build(source) for source in copies]
    assert names[0] != names[1] and names[0] == native.build(copies[0]) and all(n.startswith("step_") for n in names)
    assert native.build(copies[0], ("-DX",)) != names[0]  # and the flags
