import math

import numpy as np
import pytest
import torch
from decode_models import tiny_gpt2
from transformers import GPT2LMHeadModel

from decode.loop import baseline, speculative
from decode.models.engine import GPT2Engine
from decode.models.hf_backend import HFEngine
from decode.models.pretrained import FUSED_GELU, load_causal_lm
from decode.models.projection import LAYOUTS, default_layout, layout_for, onednn_packs
from decode.models.runtime import NativeRuntime, host_kernels, torch_mover
from decode.ranking import draw_below, draw_children, ranked_children
from decode.sampling import Sampling, Sparse, Uniforms, argmax_of_rows, sample, top_tokens, values_at
from decode.shortlist import Shortlist
from decode.tree import Tree
from decode.verify import remainder

BACKENDS = [GPT2Engine, HFEngine]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    oracle = tiny_gpt2(root / "oracle", seed=0)
    return {
        "oracle": oracle,
        "good": tiny_gpt2(root / "good", seed=1, noise_from=oracle, noise=0.005),
        "bad": tiny_gpt2(root / "bad", seed=2),
    }


def tree_mask(parents: list[int]) -> torch.Tensor:
    """What each new node sees among the new nodes: its ancestors and itself (the committed cache it sees whole)."""
    mask = torch.zeros(len(parents), len(parents), dtype=torch.bool)
    for i in range(len(parents)):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parents[j]
    return mask


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.filterwarnings("error::FutureWarning")  # e.g. transformers' renamed `past_key_values`: it goes in 5.40
def test_logits_equal_transformers_for_prompt_steps_and_tree(models, backend):
    hf = GPT2LMHeadModel.from_pretrained(models["oracle"]).eval()
    engine = backend.load(models["oracle"])
    ids = torch.randint(0, 97, (24,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = hf(ids[None]).logits[0]
    ours = torch.cat([engine.extend(ids[:10]), engine.extend(ids[10:11]), engine.extend(ids[11:14]), engine.extend(ids[14:])])
    assert torch.allclose(ours, reference, atol=1e-4)

    engine.reset()
    engine.extend(ids[:10])
    parents, tokens = [-1, 0, 0, 1, 1, 2, 3], [5, 7, 9, 11, 13, 15, 17]
    depth = [0, 1, 1, 2, 2, 2, 3]
    logits = engine.forward(torch.tensor(tokens), 10 + torch.tensor(depth), tree_mask(parents))
    for node in range(len(tokens)):
        path, j = [], node
        while j >= 0:
            path.insert(0, tokens[j])
            j = parents[j]
        with torch.no_grad():
            expected = hf(torch.cat([ids[:10], torch.tensor(path)])[None]).logits[0, -1]
        assert torch.allclose(logits[node], expected, atol=1e-4), node


def test_gpt2_gelu_loads_as_the_fused_kernel_with_the_same_logits_and_runs_on_the_lean_engine(models, tmp_path):
    ids = torch.randint(0, 97, (1, 20), generator=torch.Generator().manual_seed(0))
    stock = GPT2LMHeadModel.from_pretrained(models["oracle"]).eval()  # the checkpoint's own "gelu_new"
    loaded = load_causal_lm(models["oracle"], "oracle").eval()
    assert (stock.config.activation_function, loaded.config.activation_function) == ("gelu_new", FUSED_GELU)
    with torch.no_grad():
        assert torch.allclose(loaded(ids).logits, stock(ids).logits, atol=1e-5)
    fused = tiny_gpt2(tmp_path / "fused", seed=0, activation_function=FUSED_GELU)  # as train.loop builds models
    with torch.no_grad():
        assert torch.allclose(GPT2Engine.load(fused).extend(ids[0]), stock(ids).logits[0], atol=1e-5)


def test_bfloat16_products_of_many_rows_are_padded_to_shared_row_counts_on_a_cpu(models):
    """oneDNN builds a kernel per row count in bfloat16: a prompt's product is padded to a multiple of ROW_BLOCK
    (past PAD_ABOVE rows, above any tree's), its extra rows dropped; float32 is left as it is."""
    from decode.models.projection import PAD_ABOVE, ROW_BLOCK, Projection

    assert PAD_ABOVE % ROW_BLOCK == 0
    weight, bias = torch.randn(32, 48), torch.randn(48)
    padded = Projection(weight.bfloat16(), bias.bfloat16(), "in_out", gelu=True, pad_rows=True)
    plain = Projection(weight.bfloat16(), bias.bfloat16(), "in_out", gelu=True)
    rows_seen, multiply = [], padded.multiply
    padded.multiply = lambda x: rows_seen.append(x.shape[0]) or multiply(x)
    for rows in (1, 16, PAD_ABOVE, PAD_ABOVE + 1, PAD_ABOVE + ROW_BLOCK, PAD_ABOVE + ROW_BLOCK + 5):
        x = torch.randn(rows, 32).bfloat16()
        out = padded(x)
        assert out.shape == (rows, 48) and torch.allclose(out.float(), plain(x).float(), atol=0.1, rtol=0.02)
    assert rows_seen == [1, 16, PAD_ABOVE, PAD_ABOVE + ROW_BLOCK, PAD_ABOVE + ROW_BLOCK, PAD_ABOVE + 2 * ROW_BLOCK]
    pads = lambda engine: {p.pad_rows for layer in engine.layers for p in layer.projections()} | {engine.head.pad_rows}
    assert pads(GPT2Engine.load(models["oracle"], dtype="bfloat16")) == {True}
    assert pads(GPT2Engine.load(models["oracle"])) == {False}


@pytest.mark.parametrize("backend", BACKENDS)
def test_last_scores_only_the_last_rows_and_caches_every_one(models, backend):
    ids = torch.randint(0, 97, (12,), generator=torch.Generator().manual_seed(3))
    whole, part = backend.load(models["oracle"]), backend.load(models["oracle"])
    every = whole.extend(ids[:9])
    assert torch.allclose(part.extend(ids[:9], last=2), every[-2:], atol=1e-5)
    none = part.append(ids[9:], last=0)
    assert none.shape == (0, every.shape[1]) and (part.length, part.pending) == (9, 3)
    part.commit([0, 1, 2])
    whole.extend(ids[9:])
    probe = torch.tensor([5, 6])
    assert torch.allclose(part.extend(probe), whole.extend(probe), atol=1e-5)  # the rows without logits were cached


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("parents, path", [
    ([-1, 0, 0, 2], [0, 2, 3]),  # 9 -> 6 -> 5: two slots moved by one, overlapping their destination
    ([-1, 0, 0, 2], [0, 2]),
    ([-1, 0, 0, 2], [0, 1]),  # in place
    ([-1, 0, 1, 2, 0, 4, 5], [0, 4, 5, 6]),  # three consecutive slots moved by three: one block
    ([-1, 0, 1, 0, 3, 4, 5], [0, 3, 4, 5, 6]),  # four consecutive slots moved by two: blocks of two
    ([-1, 0, 0, 2, 0, 4, 5], [0, 4, 5, 6]),
])
@pytest.mark.parametrize("moves", ["C++", "torch"])
def test_commit_leaves_the_cache_of_feeding_the_path_token_by_token(models, backend, parents, path, moves):
    prefix, nodes = torch.tensor([3, 1, 4, 1, 5]), torch.tensor([9, 2, 6, 5, 8, 3, 1][: len(parents)])
    depths = [0]
    for parent in parents[1:]:
        depths.append(depths[parent] + 1)
    tree = backend.load(models["oracle"])
    if moves == "C++" and not isinstance(getattr(tree, "runtime", None), NativeRuntime):
        pytest.skip("the moves of a commit in C++: the lean engine on a CPU with the C++ loops built")
    if moves == "torch" and backend is GPT2Engine:
        tree.kv.move = torch_mover(tree.kv.cache)
    tree.extend(prefix)
    tree.forward(nodes, 5 + torch.tensor(depths), tree_mask(parents))
    tree.commit(path)
    chain = backend.load(models["oracle"])
    for token in prefix.tolist() + nodes[path].tolist():
        chain.extend(torch.tensor([token]))
    assert tree.length == chain.length == 5 + len(path)
    probe = torch.tensor([7])
    assert torch.allclose(tree.extend(probe), chain.extend(probe), atol=1e-5)
    if backend is GPT2Engine:
        assert torch.allclose(tree.kv_cache[:, :, :, : chain.length], chain.kv_cache[:, :, :, : chain.length], atol=1e-5)


def runnable(layout: str, dtype: torch.dtype) -> None:
    if layout == "packed" and not onednn_packs(dtype):
        pytest.skip(f"oneDNN does not prepack {dtype} weights on this CPU")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_weight_layout_gives_transformers_logits(models, layout):
    runnable(layout, torch.float32)
    hf = GPT2LMHeadModel.from_pretrained(models["oracle"]).eval()
    ids = torch.randint(0, 97, (20,), generator=torch.Generator().manual_seed(2))
    engine = GPT2Engine.load(models["oracle"], layout=layout)
    assert set(engine.layouts.values()) == {layout}
    with torch.no_grad():
        reference = hf(ids[None]).logits[0]
    ours = torch.cat([engine.extend(ids[:8]), engine.extend(ids[8:9]), engine.extend(ids[9:])])
    assert torch.allclose(ours, reference, atol=1e-4)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_bfloat16_engine_tracks_float32(models, layout):
    runnable(layout, torch.bfloat16)
    ids = torch.randint(0, 97, (30,), generator=torch.Generator().manual_seed(1))
    full = GPT2Engine.load(models["oracle"]).extend(ids)
    half = GPT2Engine.load(models["oracle"], dtype="bfloat16", layout=layout).extend(ids)
    assert (full.argmax(-1) == half.argmax(-1)).float().mean() > 0.8
    assert (full - half).abs().max() < 0.1 * full.abs().max()


@pytest.mark.parametrize("draft", ["good", "bad"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_speculative_equals_baseline(models, draft, backend):
    oracle, drafter = backend.load(models["oracle"]), backend.load(models[draft])
    rng = torch.Generator().manual_seed(3)
    accepted = []
    for trial in range(20 if backend is GPT2Engine else 5):
        prompt = torch.randint(0, 97, (int(torch.randint(1, 12, (), generator=rng)),), generator=rng)
        expected = baseline(oracle, prompt, 40, Sampling(), stop_ids={0}).tokens
        for k in (1, 4, 8):
            out = speculative(oracle, prompt, 40, Sampling(), stop_ids={0}, draft=drafter, k=k)
            assert out.tokens == expected, (trial, k)
            accepted.append(len(out.tokens) / out.oracle_calls)
    # the drafts are what they claim to be: the good one is mostly accepted, the bad one mostly not
    assert (np.mean(accepted) > 2.5) if draft == "good" else (np.mean(accepted) < 1.6)


def test_sampling_processes_temperature_top_k_and_top_p():
    logits = torch.log(torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05]))
    assert torch.allclose(Sampling(1.0).probs(logits), logits.exp(), atol=1e-6)
    assert torch.allclose(Sampling(1.0, top_k=2).probs(logits), torch.tensor([5 / 7, 2 / 7, 0, 0, 0]), atol=1e-6)
    assert torch.allclose(Sampling(1.0, top_p=0.7).probs(logits), torch.tensor([5 / 7, 2 / 7, 0, 0, 0]), atol=1e-6)
    assert torch.allclose(Sampling(1.0, top_p=0.71).probs(logits), torch.tensor([50, 20, 15, 0, 0]) / 85, atol=1e-6)
    hot = Sampling(2.0).probs(logits)
    assert torch.allclose(hot, logits.div(2).softmax(-1))
    assert Sampling().probs(logits).tolist() == [1, 0, 0, 0, 0] and sample(Sampling().probs(logits), Uniforms()) == 0


def test_uniforms_hand_out_the_generators_draws_in_order_across_its_reads():
    uniforms = Uniforms(torch.Generator().manual_seed(5))
    taken = uniforms.take(3) + uniforms.take(250) + uniforms.take(10) + uniforms.take(300)  # read at the 1st, 3rd and 4th take
    expected = torch.Generator().manual_seed(5)
    reads = [torch.rand(n, dtype=torch.float64, generator=expected).tolist() for n in (256, 256, 300)]
    assert taken == (reads[0] + reads[1] + reads[2])[:563]
    assert all(0 <= u < 1 for u in taken)


def test_proposal_is_the_processed_distribution_on_the_likeliest_tokens():
    logits = torch.log(torch.tensor([[0.05, 0.5, 0.1, 0.2, 0.15]]))
    probs, tokens = Sampling(1.0, top_k=2).proposal(logits)
    assert tokens.tolist() == [[1, 3]] and torch.allclose(probs, torch.tensor([[5 / 7, 2 / 7]]), atol=1e-6)
    probs, tokens = Sampling(1.0).proposal(logits, cap=3)  # no top-k: the cap truncates, renormalised
    assert tokens.tolist() == [[1, 3, 4]] and torch.allclose(probs, torch.tensor([[50, 20, 15]]) / 85, atol=1e-6)
    probs, tokens = Sampling(2.0, top_p=0.5).proposal(logits, cap=3)  # temperature, then top-p within the cap
    hot = torch.tensor([0.5, 0.2, 0.15]).sqrt()  # T = 2: 0.46, 0.29, 0.25 of the three; the nucleus of 0.5 keeps two
    assert tokens.tolist() == [[1, 3, 4]] and torch.allclose(probs, torch.tensor([[hot[0], hot[1], 0]]) / (hot[0] + hot[1]), atol=1e-6)
    wide = torch.randn(3, 4096, generator=torch.Generator().manual_seed(0)) * 4
    for sampling in (Sampling(1.0, top_k=50), Sampling(0.7), Sampling(1.3, top_k=100), Sampling(0.9, top_k=8, top_p=0.7)):
        probs, tokens = sampling.proposal(wide)  # bit for bit what the processed distribution of the K values is
        assert torch.equal(probs, sampling.probs(wide.gather(-1, tokens))), sampling


def test_draw_children_draws_from_the_drafts_distribution_and_returns_it():
    logits = torch.log(torch.tensor([[0.05, 0.5, 0.1, 0.2, 0.15], [0.6, 0.1, 0.2, 0.05, 0.05]]))
    drawn, q = draw_children(host_kernels(), Sampling(1.0, top_k=2), logits, 4000, Uniforms(torch.Generator().manual_seed(0)))
    assert [list(row) for row in q] == [[1, 3], [0, 2]]  # top-k: Sparse, likeliest first
    assert [list(row.values()) for row in q] == [pytest.approx([5 / 7, 2 / 7]), pytest.approx([0.75, 0.25])]
    assert q[0][2] == 0.0  # off the support
    assert set(drawn[0]) == {1, 3} and set(drawn[1]) == {0, 2}
    assert abs(drawn[0].count(1) / 4000 - 5 / 7) < 0.03 and abs(drawn[1].count(0) / 4000 - 0.75) < 0.03
    drawn, q = draw_children(host_kernels(), Sampling(1.0), logits, 4000, Uniforms(torch.Generator().manual_seed(0)))  # no top-k: the proposal
    assert torch.allclose(q, logits.softmax(-1), atol=1e-6)  # its cap (64 tokens) holds all 5, over the vocabulary
    assert abs(drawn[1].count(0) / 4000 - 0.6) < 0.03


def test_draws_below_rows_of_several_draft_calls_follow_each_rows_distribution_in_order():
    first = torch.log(torch.tensor([[0.05, 0.5, 0.1, 0.2, 0.15], [0.6, 0.1, 0.2, 0.05, 0.05]]))
    later = torch.log(torch.tensor([[0.1, 0.1, 0.1, 0.1, 0.6]]))
    for sampling in (Sampling(1.0, top_k=2), Sampling(1.0)):
        sources = [(first, 1), (later, 0), (first, 0), (first, 0)]  # a repeated row: drawn from afresh
        drawn, q = draw_below(host_kernels(), sampling, sources, 4000, Uniforms(torch.Generator().manual_seed(0)))
        for (logits, row), tokens, dist in zip(sources, drawn, q, strict=True):
            _, [expected] = draw_children(host_kernels(), sampling, logits, 1, Uniforms(), rows=[row])  # that row's q alone
            assert [float(dist[t]) for t in range(5)] == pytest.approx([float(expected[t]) for t in range(5)], abs=1e-6)
            best = max(range(5), key=lambda t: dist[t])
            assert abs(tokens.count(best) / 4000 - float(dist[best])) < 0.03, (sampling, row)
        assert drawn[2] != drawn[3]  # independent draws, not a copy


def test_a_sparse_remainder_and_draw_equal_the_vocabulary_wide_ones():
    """What multi-draft rejection samples after a rejection, normalise(max(r - q, 0)), over a support of a few tokens
    as over the whole vocabulary; and a Sparse draw inverts its cumulative sum."""
    generator = torch.Generator().manual_seed(0)
    for _ in range(20):
        r, q = (torch.rand(12, generator=generator) * (torch.rand(12, generator=generator) < 0.5) for _ in range(2))
        r[0] = q[1] = 1.0  # neither is empty
        r, q = r / r.sum(), q / q.sum()
        sparse = [Sparse((t, float(v)) for t, v in enumerate(d.tolist()) if v > 0) for d in (r, q)]
        left = remainder(*sparse)
        dense = remainder(r.double(), q.double())
        assert set(left) == set(dense.nonzero().flatten().tolist())
        assert [left[t] for t in range(12)] == pytest.approx(dense.tolist())
    assert remainder(Sparse({3: 1.0}), Sparse({3: 1.0})) == {3: 1.0}  # q covers r: nothing left, r itself
    d = Sparse({7: 0.5, 2: 0.3, 9: 0.2})
    assert [d.draw(u) for u in (0.0, 0.49, 0.5, 0.79, 0.8, 0.999)] == [7, 7, 2, 2, 9, 9] and d[4] == 0.0


@pytest.mark.parametrize("k", [1, 2])
def test_ranked_children_reads_each_edge_and_each_nodes_best_children_from_the_draft(k):
    probs = torch.rand(4, 10, generator=torch.Generator().manual_seed(0)).softmax(-1)
    tree = Tree.rooted(3)
    tree.add_level([0, 0, 1], [5, 7, 2])
    edges, best, best_probs = ranked_children(probs, tree, k, greedy=False)
    assert edges == pytest.approx([1.0, float(probs[0, 5]), float(probs[0, 7]), float(probs[1, 2])])
    top = probs.topk(k)
    assert best.tolist() == top.indices.tolist() and torch.allclose(torch.tensor(best_probs).float(), top.values)
    # greedy: ranked by the logits, each weight a probability over the likeliest sibling's, with no softmax
    edges, best, weights = ranked_children(probs.log() + 3.0, tree, k, greedy=True)
    ratio = probs / probs.max(-1, keepdim=True).values
    assert edges == pytest.approx([1.0, float(ratio[0, 5]), float(ratio[0, 7]), float(ratio[1, 2])], rel=1e-5)
    assert best.tolist() == top.indices.tolist() and torch.allclose(torch.tensor(weights).float(), ratio.topk(k).values)
    assert all(row[0] == 1.0 for row in weights)
    order = [0, 3, 1, 2]  # the draft scored node 3 second: row i is after node order[i]
    for scores, greedy in ((probs, False), (probs.log(), True)):
        reordered, plain = ranked_children(scores[order], tree, k, greedy, order), ranked_children(scores, tree, k, greedy)
        assert reordered[0] == plain[0] and (reordered[1] == plain[1]).all() and (reordered[2] == plain[2]).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # numpy's rows on CPU in float32, torch's else
def test_argmax_of_rows_gives_each_rows_first_largest_token(dtype):
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0)).to(dtype)
    logits[2, 7] = logits[2, 30] = logits[2].max() + 1  # a tie: the first index, as torch's argmax
    argmax = argmax_of_rows(logits)
    assert [argmax(row) for row in (4, 2, 0)] == logits.float().argmax(-1)[[4, 2, 0]].tolist()
    assert argmax(2) == 7


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_shortlisted_model_gives_the_whole_models_logits_at_its_tokens(models, backend):
    shortlist = Shortlist.most_frequent(np.arange(97) % 7, 40)  # counts 6 (tokens 6, 13, ...) first, ties by id
    assert len(shortlist) == 40 and list(shortlist.tokens) == sorted(shortlist.tokens)
    assert set(range(6, 97, 7)) <= set(shortlist.tokens) and 0 not in set(shortlist.tokens)
    assert all(shortlist.column[t] == i for i, t in enumerate(shortlist.tokens)) and (shortlist.column == -1).sum() == 57
    whole, short = backend.load(models["oracle"]), backend.load(models["oracle"], shortlist=shortlist)
    ids = torch.tensor([5, 17, 2, 40, 8])
    parents = [-1, 0, 0, 1, 2]
    for model in (whole, short):
        model.extend(torch.tensor([3, 9, 11]))
    expected = whole.forward(ids, torch.tensor([3, 4, 4, 5, 5]), tree_mask(parents))
    got = short.forward(ids, torch.tensor([3, 4, 4, 5, 5]), tree_mask(parents))
    assert got.shape == (5, 40)
    torch.testing.assert_close(got, expected[:, torch.from_numpy(shortlist.tokens)], atol=1e-5, rtol=1e-5)
    wide = shortlist.widen(got)
    assert torch.equal(wide[:, torch.from_numpy(shortlist.tokens)], got) and (wide == float("-inf")).sum() == 5 * 57


def test_helpers_read_a_shortlisted_models_columns_as_tokens():
    shortlist = Shortlist([7, 2, 9], 10)  # columns 0, 1, 2 stand for tokens 2, 7, 9
    logits = torch.tensor([[0.5, 3.0, 1.0], [2.0, -1.0, 0.0]])
    assert top_tokens(logits, 1, shortlist).tolist() == [[7], [2]] and top_tokens(logits, 2, shortlist).tolist() == [[7, 9], [2, 9]]
    values = values_at(logits, [0, 1, 1], [9, 2, 4], shortlist)  # token 4 is off the list
    assert values.tolist() == [1.0, 2.0, float("-inf")]
    assert values_at(logits.bfloat16(), [0, 1, 1], [9, 2, 4], shortlist).tolist() == [1.0, 2.0, float("-inf")]  # in torch
    assert values_at(logits, [1, 0], [2, 1]).tolist() == [0.0, 3.0]  # no shortlist: columns are tokens
    drawn, q = draw_children(host_kernels(), Sampling(1.0), logits, 2000, Uniforms(torch.Generator().manual_seed(0)), shortlist)
    assert q.shape == (2, 10) and torch.allclose(q[:, [2, 7, 9]], logits.softmax(-1)) and q.sum() == pytest.approx(2.0)
    assert set(drawn[0]) == {2, 7, 9} and abs(drawn[0].count(7) / 2000 - float(logits[0].softmax(-1)[1])) < 0.03
    tree = Tree.rooted(3)
    tree.add_level([0, 0], [9, 4])
    edges, best, weights = ranked_children(torch.cat([logits, logits[:1]]), tree, 1, greedy=True, shortlist=shortlist)
    assert best.tolist() == [[7], [2], [7]] and edges == pytest.approx([1.0, math.exp(1.0 - 3.0), 0.0])  # token 4: off, weight 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_matrix_layout_is_timed_only_by_calibration_and_kept(dtype, tmp_path):
    cpu = torch.device("cpu")
    assert layout_for(dtype, cpu, 64, 192, cache_dir=tmp_path) == default_layout(dtype)
    assert not list(tmp_path.iterdir())  # nothing timed, nothing kept
    chosen = layout_for(dtype, cpu, 64, 192, calibrate=True, cache_dir=tmp_path)
    assert chosen in LAYOUTS and len(list(tmp_path.iterdir())) == 1
    assert layout_for(dtype, cpu, 64, 192, cache_dir=tmp_path) == chosen  # read back
    assert layout_for(dtype, cpu, 64, 256, cache_dir=tmp_path) == default_layout(dtype)  # another shape: not calibrated
