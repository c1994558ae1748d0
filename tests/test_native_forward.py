"""The C++ forward (decode/native/forward.cpp) against torch's: a model's blocks equal up to rounding; a row's logits
the same bits alone and anywhere in a call of 2 to 64 rows, in both dtypes; a chain drafted in one call equal to one
drafted a forward at a time; decoding on it equal to the baseline; and forwards in C++ up to the rows measured
faster there."""
import random

import pytest
import torch
from decode_models import tiny_gpt2, tiny_llama, tiny_trigram
from native_built import random_tree

from decode import devices, machine, native, provenance
from decode.drafting import ChainDrafter, LookupDrafter, ShapedTreeDrafter, StagedDrafter
from decode.errors import InputError
from decode.loop import baseline, tree_speculative
from decode.models import engine as engine_module
from decode.models.engine import GPT2Engine
from decode.models.llama import LlamaEngine
from decode.models.runtime import TORCH
from decode.models.successors import SuccessorTable
from decode.sampling import Sampling
from decode.shortlist import Shortlist
from decode.tree import Tree


def needs_cpp_forward(dtype: str) -> None:
    """Skip unless this CPU runs the C++ forward of a model in `dtype`; fail where it should and did not build."""
    if native.forward_module(getattr(torch, dtype)) is None:
        if native.forward_build(getattr(torch, dtype)) is not None:
            pytest.fail(f"the C++ forward did not build on a CPU that runs its {native.forward_build(getattr(torch, dtype))} "
                        f"build (see the note above)")
        pytest.skip("this CPU has neither AVX2 with FMA nor AVX-512: the models' forwards run in torch")


def tiny_model(architecture: str, path, seed: int, n_embd: int = 32, n_head: int = 4, **options):
    """A tiny model of this architecture (gpt2, llama: grouped-query attention, two query heads a key/value head;
    qwen2: q/k/v biases too) and the engine class that runs it."""
    if architecture == "gpt2":
        return tiny_gpt2(path, seed=seed, n_embd=n_embd, n_head=n_head, **options), GPT2Engine
    return tiny_llama(path, architecture, seed=seed, hidden_size=n_embd, heads=n_head,
                      kv_heads=options.pop("kv_heads", max(1, n_head // 2)),
                      intermediate_size=options.pop("intermediate_size", 2 * n_embd + 16), **options), LlamaEngine


ARCHITECTURES = ["gpt2", "llama", "qwen2"]


@pytest.fixture
def blocks_here(built):
    needs_cpp_forward("bfloat16")
    return native.forward_module(torch.bfloat16)


def strays_as_far_as_torch(got: torch.Tensor, in_torch: torch.Tensor, reference: torch.Tensor, dtype: str) -> bool:
    """Whether the C++ strays from the reference about as far as torch does in the same dtype: on average within
    twice torch's error (bfloat16 rounds at 2^-8 relative, float32 at 2^-24), and nowhere by much more than torch's
    largest error (in bfloat16 a rounding in the cache carries into every later forward, one way's in one place and
    the other's in another, so the largest errors of the two differ by more than their averages)."""
    mean_slack, max_slack = (0.01, 0.05) if dtype == "bfloat16" else (1e-5, 1e-5)
    error, torch_error, scale = (got - reference).abs(), (in_torch - reference).abs(), reference.abs()
    return bool(error.mean() <= 2 * torch_error.mean() + mean_slack * scale.mean()
                and error.max() <= 2 * torch_error.max() + max_slack * scale.max())


@pytest.mark.parametrize("n_embd, n_head, shortlist", [  # heads of 8 (float32 attention) and of 32 (BF16); output
    (32, 4, None), (64, 2, None), (32, 4, 40),  # layers of 97 columns and of a shortlist's 40: neither a multiple of 16
    (256, 4, None)])  # products large enough to be split among threads
@pytest.mark.parametrize("dtype, tiles", [("bfloat16", False), ("bfloat16", True), ("float32", False)])
@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_a_models_blocks_in_cpp_equal_torchs_up_to_rounding(built, monkeypatch, tmp_path, n_embd, n_head, shortlist,
                                                            dtype, tiles, architecture):
    needs_cpp_forward(dtype)
    directory, engine_class = tiny_model(architecture, tmp_path / "draft", 2, n_embd, n_head)
    shortlist = shortlist and Shortlist(random.Random(1).sample(range(97), shortlist), 97)
    in_torch, in_cpp = (engine_class.load(directory, dtype, native_blocks=cpp, shortlist=shortlist)
                        for cpp in (False, True))
    if tiles and not in_cpp.runtime.blocks.can_tile:
        pytest.skip("no AMX-BF16 here (or the model is not one the tiles take): the products run as vector dot products")
    if dtype == "float32":  # the reference for float32 roundings is the same model in float64
        monkeypatch.setitem(engine_module.DTYPES, "float64", torch.float64)
    exact = engine_class.load(directory, "float32" if dtype == "bfloat16" else "float64", shortlist=shortlist)
    assert in_torch.runtime.blocks is None and in_cpp.runtime.blocks is not None
    in_cpp.runtime.blocks.tiles = tiles
    assert in_cpp.runtime.blocks.tiles == tiles
    rows = []
    inner = in_cpp.runtime.blocks.__call__
    monkeypatch.setattr(in_cpp.runtime, "blocks", lambda *args: rows.append(len(args[1])) or inner(*args))
    rng = random.Random(0)
    tree = random_tree(rng, 15, 97)
    forwards = [  # a prompt past the C++ call's rows (in calls of its rows), one within them, a tree under a mask, a
        # chain after the commit, one node
        lambda m: m.extend(torch.tensor([rng.randrange(97) for _ in range(native.Blocks.ROWS + 8)]), last=5),
        lambda m: m.extend(torch.tensor([rng.randrange(97) for _ in range(20)]), last=5),
        lambda m: m.forward(tree.tokens, tree.positions(m.length), tree.mask()),
        lambda m: (m.commit(tree.path(len(tree) - 1)), m.forward(torch.tensor([3, 4, 5]), torch.arange(3) + m.length, None))[1],
        lambda m: m.forward(torch.tensor([6]), torch.tensor([m.length + m.pending]), None),
    ]
    agree, torch_agrees = [], []
    for forward in forwards:
        state = rng.getstate()
        expected = forward(in_torch)
        rng.setstate(state)  # the same random prompt for each
        reference = forward(exact)
        rng.setstate(state)
        got = forward(in_cpp)
        assert got.shape == expected.shape and got.dtype == torch.float32
        assert strays_as_far_as_torch(got, expected, reference, dtype)
        # in bfloat16, how often each picks the reference's best token: near ties go either way in either
        agree += (got.argmax(-1) == reference.argmax(-1)).tolist()
        torch_agrees += (expected.argmax(-1) == reference.argmax(-1)).tolist()
        slots = in_torch.length + in_torch.pending
        assert in_cpp.length + in_cpp.pending == slots
        cached, exact_cache = (m.kv_cache[..., :slots, :].float() for m in (in_torch, exact))
        assert strays_as_far_as_torch(in_cpp.kv_cache[..., :slots, :].float(), cached, exact_cache, dtype)
    # (29 rows: a near tie more or less moves the count by 3%)
    assert sum(agree) >= (sum(torch_agrees) - 0.15 * len(agree) if dtype == "bfloat16" else len(agree))
    assert rows == [native.Blocks.ROWS, 8, 20, 15, 3, 1]  # every forward took the C++ call, the long prompt two
    with pytest.raises(IndexError, match="out of range"):  # as torch's embedding refuses them, not a read past wte
        in_cpp.forward(torch.tensor([97]), torch.tensor([in_cpp.length]), None)


DTYPES_AND_PRODUCTS = [("bfloat16", False), ("bfloat16", True), ("float32", False)]
# an oracle's and a draft's shape: heads of 32 (the vector attention, or one tile step on AMX) and of 8 (part of a
# vector, or one by one); and heads of 64, the presets' (two tile steps)
SHAPES = [(64, 2), (32, 4), (128, 2)]


def engine_in_cpp(made: tuple, dtype: str, tiles: bool):
    """The model tiny_model `made`, its forwards in C++, its products on AMX's tiles with `tiles`."""
    needs_cpp_forward(dtype)
    directory, engine_class = made
    engine = engine_class.load(directory, dtype, native_blocks=True)
    if tiles and not engine.runtime.blocks.can_tile:
        pytest.skip("no AMX-BF16 here: the products run as vector dot products")
    engine.runtime.blocks.tiles = tiles
    return engine


@pytest.mark.parametrize("dtype, tiles", DTYPES_AND_PRODUCTS)
@pytest.mark.parametrize("n_embd, n_head", SHAPES)
@pytest.mark.parametrize("architecture", ARCHITECTURES[:2])
def test_a_rows_logits_in_cpp_do_not_depend_on_the_forwards_other_rows(built, tmp_path, dtype, tiles, n_embd, n_head,
                                                                       architecture):
    # what keeps a greedy speculative decoding's tokens those of one token a forward, bit for bit
    engine = engine_in_cpp(tiny_model(architecture, tmp_path / "model", 3, n_embd, n_head), dtype, tiles)
    engine.extend(torch.tensor([5, 6, 7, 8]))
    chain = [9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26]  # more rows than a tile holds
    together = engine.forward(chain, list(range(engine.length, engine.length + len(chain))), None)
    engine.commit([])
    for i, token in enumerate(chain):
        alone = engine.forward([token], [engine.length], None)
        engine.commit([0])
        assert torch.equal(alone[0], together[i])


def assert_a_rows_bits_alone_anywhere_in_a_call_of_2_to_64_rows(engine) -> None:
    """One row's logits alone, then the same token as each of the first, middle and last rows of calls of 2 to 64
    sibling rows: the same bits every time."""
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


@pytest.mark.parametrize("dtype, tiles", DTYPES_AND_PRODUCTS)
@pytest.mark.parametrize("n_embd, n_head", SHAPES)
@pytest.mark.parametrize("architecture", ARCHITECTURES[:2])
def test_a_rows_logits_in_cpp_are_the_same_bits_alone_and_anywhere_in_a_call_of_2_to_64_rows(built, tmp_path, dtype,
                                                                                            tiles, n_embd, n_head,
                                                                                            architecture):
    engine = engine_in_cpp(tiny_model(architecture, tmp_path / "model", 3, n_embd, n_head), dtype, tiles)
    assert_a_rows_bits_alone_anywhere_in_a_call_of_2_to_64_rows(engine)


@pytest.mark.parametrize("dtype, tiles", DTYPES_AND_PRODUCTS)
def test_a_rows_logits_are_the_same_bits_whether_its_query_heads_are_scored_with_their_group_or_apart(built, tmp_path,
                                                                                                    dtype, tiles):
    # four query heads on one key/value head: a call of up to 16 rows scores the four together, of 17 to 32 three or
    # two at a time, of more one at a time (an MLP of 256, so that every product's input tiles)
    engine = engine_in_cpp(tiny_model("llama", tmp_path / "model", 3, 128, 4, kv_heads=1, intermediate_size=256), dtype,
                           tiles)
    assert_a_rows_bits_alone_anywhere_in_a_call_of_2_to_64_rows(engine)


@pytest.mark.parametrize("dtype, tiles", DTYPES_AND_PRODUCTS)
def test_a_prompt_longer_than_a_cpp_call_is_read_in_calls_that_give_each_row_the_bits_it_gets_alone(built, tmp_path,
                                                                                                 dtype, tiles):
    engine = engine_in_cpp(tiny_model("gpt2", tmp_path / "model", 3), dtype, tiles)
    prompt = torch.randint(0, 97, (native.Blocks.ROWS + 50,), generator=torch.Generator().manual_seed(1))
    blocks, calls = engine.runtime.blocks, []
    engine.runtime.blocks = lambda cache, ids, *rest: calls.append(len(ids)) or blocks(cache, ids, *rest)
    together = engine.extend(prompt)
    assert calls == [native.Blocks.ROWS, 50]
    engine.runtime.blocks = blocks
    engine.reset()
    assert torch.equal(engine.extend(prompt, last=60), together[-60:])  # rows of both calls
    engine.reset()
    for i, token in enumerate(prompt.tolist()):
        assert torch.equal(engine.extend(torch.tensor([token]))[0], together[i]), f"row {i}"


def test_an_engine_whose_forwards_run_in_cpp_makes_torchs_weights_only_when_a_torch_forward_needs_them(blocks_here,
                                                                                                      tmp_path):
    directory = tiny_gpt2(tmp_path / "model", seed=3)
    engine = GPT2Engine.load(directory, "bfloat16", native_blocks=True)
    prompt = torch.randint(0, 97, (native.Blocks.ROWS + 20,), generator=torch.Generator().manual_seed(2))
    in_cpp = engine.extend(prompt, last=4)  # past one C++ call's rows: in two of them
    assert engine.made_torch_weights is None
    engine.reset()
    engine.runtime.use(0, False)  # as where torch measured faster: torch's forward, its weights read again from the files
    in_torch = engine.extend(prompt, last=4)
    assert engine.made_torch_weights is not None and torch.equal(in_torch.argmax(-1), in_cpp.argmax(-1))
    eager = GPT2Engine.load(directory, "bfloat16")  # no C++ call: torch's weights made as it is built
    assert torch.equal(eager.extend(prompt, last=4), in_torch)


def test_a_prompt_read_in_torch_gives_its_last_row_the_bits_the_cpp_call_gives_it_alone(blocks_here, tmp_path):
    """Where torch reads many rows faster, a prompt past the C++ call's rows is read there but for the row whose
    logits are asked, which the C++ call scores: as a speculative method's first tree scores the prompt's last token
    after the rest of the prompt, so that both start from the same logits."""
    engine = GPT2Engine.load(tiny_gpt2(tmp_path / "model", seed=5, n_embd=64, n_head=2), "bfloat16", native_blocks=True)
    engine.runtime.use(2, False)  # as where torch measured faster from 4 rows on
    prompt = torch.randint(0, 97, (11,), generator=torch.Generator().manual_seed(6))
    whole = engine.extend(prompt, last=1)
    assert engine.made_torch_weights is not None  # the rest of the prompt went through torch
    engine.reset()
    engine.extend(prompt[:-1], last=0)
    assert torch.equal(engine.extend(prompt[-1:], last=1), whole)
    engine.reset()
    in_torch = engine.extend(prompt, last=3)  # more rows asked than one C++ call takes: all of them in torch
    engine.runtime.use(0, False)
    engine.reset()
    assert torch.equal(engine.extend(prompt, last=3), in_torch)


def test_the_near_tie_checker_replays_a_cpp_forward_in_torch_too(blocks_here, tmp_path):
    from decode.benchmarking import near_ties

    engine = GPT2Engine.load(tiny_gpt2(tmp_path / "model", seed=3, n_embd=64, n_head=2), "bfloat16",
                             native_blocks=True)
    context = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]
    rows = near_ties.replayed_logits(engine, context, 3)
    with engine.runtime.forced(TORCH):
        in_torch = near_ties.replayed_logits(engine, context, 3)
    half = len(in_torch)
    assert len(rows) == 2 * half and torch.equal(rows[half:], in_torch)
    assert (rows[:half] == rows[0]).all()  # the C++ replays agree to the bit, the cache written in chunks of any size


@pytest.mark.parametrize("architecture", ARCHITECTURES[:2])
def test_decoding_with_a_drafts_blocks_in_cpp_equals_the_baseline(blocks_here, monkeypatch, tmp_path, architecture):
    oracle_dir, engine_class = tiny_model(architecture, tmp_path / "oracle", 0)
    oracle = engine_class.load(oracle_dir)
    draft = engine_class.load(tiny_model(architecture, tmp_path / "draft", 1, noise_from=oracle_dir, noise=0.005)[0],
                              "bfloat16", native_blocks=True)
    table = SuccessorTable.load(tiny_trigram(tmp_path / "ngram", oracle_dir) / "successors.npz")
    calls = []
    inner = draft.runtime.blocks.__call__
    monkeypatch.setattr(draft.runtime, "blocks", lambda *args: calls.append(len(args[1])) or inner(*args))
    staged = StagedDrafter(draft, table, budget=12, widths=[3, 2, 1], context=LookupDrafter())
    for prompt in ([4, 9, 17], [11, 12, 13, 14, 11, 12]):
        prompt = torch.tensor(prompt)
        out = tree_speculative(oracle, prompt, 32, Sampling(), stop_ids={0}, drafter=staged)
        assert out.tokens == baseline(oracle, prompt, 32, Sampling(), stop_ids={0}).tokens
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
            monkeypatch.setattr(draft, "chains", lambda rows, setting, one_call=one_call: one_call and fits(rows, setting))
            monkeypatch.setattr(draft, "chain", lambda *args, seen=calls[one_call]: seen.append(args) or inner(*args))
            monkeypatch.setattr(drafter, "propose", lambda *args, seen=made[one_call], propose=propose:
                                seen.append(propose(*args)) or seen[-1])
            for seed, prompt in enumerate(([4, 9, 17], [11, 12, 13, 14, 11, 12] * 3)):
                out = tree_speculative(oracle, torch.tensor(prompt), 40, sampling, stop_ids=(), drafter=drafter,
                                       generator=torch.Generator().manual_seed(seed))
                made[one_call].append(out.tokens)
        drafted = sum(isinstance(t, Tree) and len(t) > 1 for t in made[True])
        assert len(calls[True]) == drafted and not calls[False]  # every proposal in one call, or none in any
        assert [(t.tokens, t.parents, t.child_dists) if isinstance(t, Tree) else t for t in made[True]] == \
               [(t.tokens, t.parents, t.child_dists) if isinstance(t, Tree) else t for t in made[False]]


def test_a_forward_runs_in_cpp_up_to_the_rows_measured_faster_there_and_the_choice_is_kept(blocks_here, monkeypatch,
                                                                                          tmp_path):
    from decode.models import native_rows

    directory = tiny_gpt2(tmp_path / "model", seed=2)
    engine = GPT2Engine.load(directory, "bfloat16", native_blocks=True)
    tiles_here = engine.runtime.blocks.can_tile
    monkeypatch.setattr(native.Blocks, "can_tile", True)  # both ways of the products timed, on any CPU
    timed, tiles_win = [], True

    def forward_costs(model, repeats, counts):  # C++ faster up to 8 rows, and again at 32: the first crossing counts
        # (one row slowed by other work in the first round only); the tiles' products faster but at one row, or slower
        timed.append((model.runtime.rows, model.runtime.tiles))
        if not model.runtime.rows:
            return {q: 2.0 for q in counts}
        if model.runtime.tiles:
            return {q: (1.2 if q == 1 else 0.5 if tiles_win else 1.9) for q in counts}
        burst = timed.count(timed[-1]) == 1
        return {q: (9.0 if q == 1 and burst else 1.0 if q <= 8 or q == 32 else 3.0) for q in counts}

    monkeypatch.setattr(native_rows, "forward_costs", forward_costs)
    uncalibrated = native_rows.native_forward(directory, engine, "bfloat16", tmp_path / "cache")
    # the default, untimed: every row count in C++, on the tiles where this CPU has them
    assert uncalibrated == native_rows.NativeForward(native.Blocks.ROWS, tiles_here) and not timed
    for calibrate in (True, False):  # measured and kept, then read back
        assert native_rows.native_forward(directory, engine, "bfloat16", tmp_path / "cache", calibrate=calibrate) == (
            native_rows.NativeForward(64, True))
    rows = max(native_rows.ROW_COUNTS)
    # timed every way in turn, native_rows.ROUNDS times, then read back
    assert timed == [(rows, False), (rows, True), (0, engine.runtime.blocks.tiles)] * native_rows.ROUNDS
    tiles_win = False
    timed.clear()
    assert native_rows.native_forward(directory, engine, "bfloat16", tmp_path / "other", calibrate=True) == (
        native_rows.NativeForward(8, False))
    assert native_rows.native_forward(directory, GPT2Engine.load(directory, "float32"), "float32") == (
        native_rows.NativeForward(0, False))  # no C++ forward

    engine.runtime.use(8, engine.runtime.tiles)
    rows = []
    inner = engine.runtime.blocks.__call__
    monkeypatch.setattr(engine.runtime, "blocks", lambda *args: rows.append(len(args[1])) or inner(*args))
    engine.extend(torch.tensor([5, 6, 7, 8, 9, 10, 11, 12, 13]))
    for q in (8, 1):
        engine.forward(torch.arange(q), torch.arange(q) + engine.length, None)
        engine.commit([])
    assert rows == [8, 1]  # the nine-row prompt ran in torch


def test_the_cpp_forward_refuses_a_tensor_of_another_element_type_or_an_output_of_another_shape(blocks_here, tmp_path):
    engine = GPT2Engine.load(tiny_gpt2(tmp_path / "model", seed=3), "bfloat16", native_blocks=True)
    blocks = engine.runtime.blocks
    address, elements, _ = blocks.spec["wpe"]
    with pytest.raises(TypeError, match="wpe has 4-byte elements where the model reads 2-byte ones"):
        blocks.forward.model(blocks.spec | {"wpe": (address, elements, 4)})
    with pytest.raises(ValueError, match="the output layer's columns, which must then cover the vocabulary"):
        blocks.forward.model(blocks.spec | {"vocabulary": blocks.spec["vocabulary"] + 1})
    with pytest.raises(TypeError, match="norm_f.weight has 2-byte elements where the model reads 4-byte ones"):
        blocks.forward.model(blocks.spec | {"norm_f.weight": (*blocks.spec["norm_f.weight"][:2], 2)})
    rows = {"model": blocks.model, "cache": engine.kv.field, "ids": [1, 2], "positions": [0, 1],
            "start": 0, "mask": None, "last": 2}
    blocks.forward.blocks(**rows, out=torch.empty(2, blocks.columns).numpy())
    with pytest.raises(ValueError, match="out must be"):
        blocks.forward.blocks(**rows, out=torch.empty(1, blocks.columns).numpy())
    with pytest.raises(TypeError, match="out must be"):
        blocks.forward.blocks(**rows, out=torch.empty(2, blocks.columns, dtype=torch.float64).numpy())
    with pytest.raises(TypeError, match="mask must be"):  # a mask of bytes, not of booleans
        blocks.forward.blocks(**rows | {"mask": torch.ones(2, 2, dtype=torch.uint8).numpy()},
                              out=torch.empty(2, blocks.columns).numpy())


EMBEDDED = [(make, tied, dtype, weights) for make, tied in ((tiny_gpt2, True), (tiny_llama, True), (tiny_llama, False))
            for dtype, weights in (("bfloat16", None), ("float32", None), ("float32", "q8_0"), ("float32", "q4_0"))
            if tied or weights]  # (an untied 16-bit model's embeddings are its wte)


@pytest.mark.parametrize("make, tied, dtype, weights", EMBEDDED)
def test_embeddings_read_in_packed_blocks_are_the_embeddings(tmp_path, make, tied, dtype, weights):
    """A model holds its embeddings once: a tied model's in its packed output layer, a quantized one's in their
    blocks. Each token's embedding read there gives the logits a lookup in the embeddings themselves gives, bit for
    bit."""
    from decode.cli import quantize

    needs_cpp_forward(dtype)
    model = make(tmp_path / "model", seed=3, **({"tie_word_embeddings": tied} if make is tiny_llama else {}))
    if weights is not None:
        quantize.main(["--model", str(model), "--to", weights, "--out", str(tmp_path / weights)])
        model = tmp_path / weights
    engine = (GPT2Engine if make is tiny_gpt2 else LlamaEngine).load(model, dtype, native_blocks=True)
    blocks = engine.runtime.blocks
    if blocks is None:
        pytest.skip("this CPU lacks the quantized products' instructions")
    assert "wte" not in blocks.spec and ("embeddings.packed" in blocks.spec) == (not tied)
    embeddings = engine.embedding.contiguous()  # torch's, made from the checkpoint (dequantized) on its first use
    spec = {name: field for name, field in blocks.spec.items() if name != "embeddings.packed"}
    looked_up = blocks.forward.model(spec | {"wte": native.tensor_field(embeddings)})
    blocks.forward.tiles(model=looked_up, on=blocks.tiles)  # the same products (a bfloat16 model's round otherwise)
    rows = {"cache": engine.kv.field, "ids": list(range(engine.vocab_size)), "positions": [0] * engine.vocab_size,
            "start": 0, "mask": torch.eye(engine.vocab_size, dtype=torch.bool).numpy(), "last": engine.vocab_size}
    read, given = (torch.empty(engine.vocab_size, blocks.columns) for _ in range(2))
    blocks.forward.blocks(model=blocks.model, **rows, out=read.numpy())
    blocks.forward.blocks(model=looked_up, **rows, out=given.numpy())
    assert torch.equal(read, given)


def test_a_cpu_taken_for_one_with_avx2_alone_runs_the_avx2_build_and_its_results_say_so(monkeypatch):
    if not {"avx2", "fma"} <= machine.cpu_flags(actual=True):
        pytest.skip("this CPU lacks AVX2 with FMA")
    cpu = torch.device("cpu")
    monkeypatch.setenv(machine.AS_CPU, "avx2")
    assert not any(flag.startswith(("avx512", "amx")) for flag in machine.cpu_flags())
    assert native.forward_build(torch.bfloat16) == native.forward_build(torch.float32) == "AVX2"
    assert machine.cpu_features() == "AVX2" and not devices.native_bfloat16(cpu)[0]
    assert devices.machine_name(cpu).startswith(f"{machine.cpu_name()} ({machine.cpu_features(actual=True)}, run with AVX2 alone)")
    assert "run with AVX2 alone" in devices.device_name(cpu)  # the dtype and calibration caches' name for it
    assert provenance.command_line("python -m decode.bench", ["--limit", "5"]) == \
        "STAGED_SPECULATIVE_CPU=avx2 python -m decode.bench --limit 5"  # what a result records: a command that repeats it
    monkeypatch.setenv(machine.AS_CPU, "avx512")
    with pytest.raises(InputError, match="set it to avx2"):
        machine.cpu_flags()
    monkeypatch.delenv(machine.AS_CPU)
    assert machine.cpu_flags() == machine.cpu_flags(actual=True) and "run with" not in devices.machine_name(cpu)
    assert provenance.command_line("python -m decode.bench", ["--limit", "5"]) == "python -m decode.bench --limit 5"
    monkeypatch.setenv("LLAMA_ARG_REPACK", "0")  # a setting llama.cpp's peers read
    assert provenance.command_line("python -m decode.bench", []) == "LLAMA_ARG_REPACK=0 python -m decode.bench "
