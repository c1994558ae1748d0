"""Quantized weights: llama.cpp's Q8_0 and Q4_0 blocks made bit for bit as its reference quantizer makes them, each
C++ build's products over them against a float64 reference, a row's logits whatever the call's other rows, every
method's greedy output equal to the quantized oracle's plain decoding, and the refusals."""
import json
import shutil

import gguf
import numpy as np
import pytest
import torch
from decode_models import run_models, tiny_gpt2
from native_built import compiler_found
from train_runs import error_of

from decode import native
from decode.cli import quantize, run
from decode.machine import cpu_flags
from decode.models.engine import GPT2Engine, dequantized_matrices
from decode.models.loading import load_model
from decode.models.pretrained import load_safetensors
from decode.models.quantize_model import quantize_checkpoint
from decode.models.quantized import (
    FORMATS,
    Q4_0,
    Q8_0,
    QUANTIZED_FILE,
    QuantizedMatrix,
    format_of,
    reciprocal_or_zero,
    split_checkpoint,
)

GGUF_TYPES = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0}


@pytest.mark.parametrize("fmt", FORMATS)
def test_blocks_are_the_bits_of_llamacpps_reference_quantizer(fmt):
    generator = torch.Generator().manual_seed(0)
    for scale in (0.02, 1.0, 300.0):
        w = torch.randn(40, 256, generator=generator) * scale
        w[0, :32] = 0  # a block of zeros: scale 0
        w[1, 3], w[1, 20] = 5 * scale, -5 * scale  # two weights of the largest magnitude: the first one sets Q4_0's sign
        w[2, 32:64] = torch.arange(32) * scale / 2  # values that land on halves of a step
        matrix = QuantizedMatrix.quantize(w, FORMATS[fmt])
        reference = gguf.quants.quantize(w.numpy(), GGUF_TYPES[fmt])
        assert np.array_equal(matrix.block_bytes().numpy(), reference)
        assert np.array_equal(matrix.dequantize().numpy(), gguf.quants.dequantize(reference, GGUF_TYPES[fmt]))
        # a step d = max |w| / 127 (Q8_0) or / 8 (Q4_0, whose far end may clip by a step): half a step or a step,
        # and the float16 scale's rounding times the largest value
        step = w.abs().reshape(40, -1, 32).amax(-1, keepdim=True) / (127 if fmt == "q8_0" else 8)
        bound = step * ((0.5 if fmt == "q8_0" else 1.0) + 127 * 2**-11)
        assert ((matrix.dequantize() - w).abs().reshape(40, -1, 32) <= bound).all()


@pytest.fixture(scope="module")
def quantized_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("quantized")
    source = tiny_gpt2(root / "source", vocab_size=101, n_embd=64, n_head=4, seed=3)
    for name, fmt in FORMATS.items():
        quantize_checkpoint(source, root / name, fmt)
    return root


def float64_logits(directory, ids: list[int]) -> torch.Tensor:
    """The quantized model's logits computed by transformers' GPT-2 in float64 from its dequantized weights."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = json.loads((directory / "config.json").read_text())
    dense, quantized = split_checkpoint(load_safetensors(directory), format_of(config, directory), directory)
    model = GPT2LMHeadModel(GPT2Config.from_pretrained(directory)).double().eval()
    weights = dense | dequantized_matrices(quantized)
    model.transformer.load_state_dict({name: w.double() for name, w in weights.items()})
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def product_reference(x: torch.Tensor, matrix: QuantizedMatrix, bias: torch.Tensor) -> torch.Tensor:
    """x @ W + bias in float64, x's rows quantized as the products quantize them: each block of 32 to int8 values
    round(x / s) (to nearest even), s = max |x| / 127 in float32, summed against the weights' values exactly."""
    blocks = x.reshape(x.shape[0], -1, 32)
    scale = blocks.abs().amax(-1, keepdim=True) / 127
    values = (blocks * reciprocal_or_zero(scale)).round().clamp(-127, 127).double()
    dots = torch.einsum("rgk,cgk->rgc", values, matrix.values().reshape(matrix.shape[0], -1, 32).double())
    return (dots * scale.double() * matrix.scales.double().T[None]).sum(1) + bias.double()


BUILDS_HERE = [name for name, (_, needs) in native.FORWARD_BUILDS.items() if needs <= cpu_flags()]


def cpp_product(module, matrix: QuantizedMatrix, bias: torch.Tensor, x: torch.Tensor, tiles: bool = False
                ) -> torch.Tensor:
    """x @ W + bias by a forward build's quantized product (on AMX's tiles with `tiles`), W's columns only."""
    out = torch.empty(len(x), matrix.shape[0])
    module.quantized_product(format=matrix.format.code, packed=native.pack_quantized(matrix).numpy(),
                             bias=bias.numpy(), x=x.numpy(), out=out.numpy(), tiles=tiles)
    return out


@pytest.mark.parametrize("fmt", FORMATS)
def test_packing_a_matrix_allocates_its_packed_bytes_and_nothing_else(fmt):
    # a load packs each matrix while it keeps those packed before: a temporary a matrix, freed between them, would
    # leave the allocator's heap holding its pages, and the load's peak memory would vary from run to run
    matrix = QuantizedMatrix.quantize(torch.randn(512, 256, generator=torch.Generator().manual_seed(0)), FORMATS[fmt])
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as profile:
        packed = native.pack_quantized(matrix)
    allocated = sum(event.self_cpu_memory_usage for event in profile.events() if event.self_cpu_memory_usage > 0)
    assert allocated == packed.nbytes


@pytest.mark.skipif(not compiler_found(), reason="no C++ compiler or ninja here")
@pytest.mark.parametrize("build", BUILDS_HERE)
@pytest.mark.parametrize("fmt", FORMATS)
def test_each_builds_products_over_blocks_equal_a_float64_reference(build, fmt):
    module = native._forward_build(build)
    if not module.quantized_supported():
        pytest.skip(f"this CPU lacks the {build} build's quantized instructions")
    generator = torch.Generator().manual_seed(1)
    w, x = torch.randn(75, 256, generator=generator), torch.randn(9, 256, generator=generator) * 3
    x[0, :32], x[1, 5] = 0, 400  # a block of zeros; a block whose other values round to few steps
    matrix, bias = QuantizedMatrix.quantize(w, FORMATS[fmt]), torch.zeros(80)
    bias[:75] = torch.randn(75, generator=generator)
    out = cpp_product(module, matrix, bias, x)
    reference = product_reference(x, matrix, bias[:75])
    assert (out.double() - reference).abs().max() <= 1e-6 * reference.abs().max()  # float32's rounding of the sums
    assert torch.equal(cpp_product(module, matrix, bias, x[4:5])[0], out[4])


@pytest.mark.skipif(not compiler_found(), reason="no C++ compiler or ninja here")
@pytest.mark.skipif("amx_int8" not in cpu_flags(), reason="this CPU lacks AMX-INT8")
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rows", [8, 16, 21, 40])  # the tiles take calls of 8 rows on, 16 at a time
def test_products_on_amx_tiles_are_bit_for_bit_the_dot_products(fmt, rows):
    module = native._forward_build("AVX-512")
    generator = torch.Generator().manual_seed(rows)
    w, x = torch.randn(200, 320, generator=generator), torch.randn(rows, 320, generator=generator) * 3
    x[0, 32:64] = 0
    matrix, bias = QuantizedMatrix.quantize(w, FORMATS[fmt]), torch.randn(208, generator=generator)
    out = {tiles: cpp_product(module, matrix, bias, x, tiles) for tiles in (False, True)}
    assert torch.equal(out[True], out[False])
    reference = product_reference(x, matrix, bias[:200])
    assert (out[True].double() - reference).abs().max() <= 1e-6 * reference.abs().max()


@pytest.mark.skipif(not compiler_found(), reason="no C++ compiler or ninja here")
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_quantized_models_cpp_forward_is_near_its_dequantized_model_and_a_rows_logits_do_not_depend_on_other_rows(
        quantized_models, fmt, dtype):
    directory = quantized_models / fmt
    engine = GPT2Engine.load(directory, dtype, native_blocks=True)
    if engine.runtime.blocks is None:
        pytest.skip("no C++ forward for this CPU")
    ids = [5, 7, 9, 11, 13, 2, 3, 50, 99, 1, 4]
    together = engine.forward(ids, list(range(len(ids))), None)
    reference = float64_logits(directory, ids)
    # the products read each row in 8-bit blocks (the test above checks them exactly): a few percent of the logits
    assert (together.double() - reference).abs().max() <= 0.1 * reference.abs().max()
    alone = GPT2Engine.load(directory, dtype, native_blocks=True)
    rows = torch.cat([alone.forward([token], [i], None) for i, token in enumerate(ids)])
    assert torch.equal(rows, together)


@pytest.mark.skipif(not compiler_found(), reason="no C++ compiler or ninja here")
def test_a_quantized_model_runs_every_forward_in_cpp_even_where_torch_times_faster(quantized_models, monkeypatch,
                                                                                   tmp_path):
    """torch's forward of the dequantized weights is not the quantized model (its inputs are not quantized): were
    calibration to send a long prompt there, the prompt's last row would differ from the same row scored in C++ as a
    tree's root, and speculation would leave the plain decoding's output."""
    from decode.models import native_rows
    from decode.models.runtime import TORCH

    directory = quantized_models / "q8_0"
    engine = GPT2Engine.load(directory, "bfloat16", native_blocks=True)
    if engine.runtime.blocks is None:
        pytest.skip("no C++ forward for this CPU")
    monkeypatch.setattr(native.Blocks, "can_tile", False)
    monkeypatch.setattr(native_rows, "forward_costs",  # torch's forward faster from two rows on
                        lambda model, repeats, counts: {q: (1.0 if model.runtime.rows else 0.5 + 0.6 / q) for q in counts})
    chosen = native_rows.native_forward(directory, engine, "bfloat16", tmp_path, calibrate=True)
    assert chosen == native_rows.NativeForward(native.Blocks.ROWS, False)
    dense = tiny_gpt2(tmp_path / "dense", vocab_size=101, n_embd=64, n_head=4, seed=3)
    dense_engine = GPT2Engine.load(dense, "bfloat16", native_blocks=True)
    assert TORCH in dense_engine.runtime.ways()
    assert native_rows.native_forward(dense, dense_engine, "bfloat16", tmp_path, calibrate=True).rows == 1
    engine.runtime.use(chosen.rows, chosen.tiles)
    prompt = torch.randint(0, 101, (native.Blocks.ROWS + 9,), generator=torch.Generator().manual_seed(4))
    whole = engine.extend(prompt, last=1)
    engine.reset()
    engine.extend(prompt[:-1], last=0)
    assert torch.equal(engine.extend(prompt[-1:], last=1), whole)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_model_quantized_as_it_loads_is_its_quantized_checkpoint(quantized_models, fmt):
    ids = [5, 7, 9, 11, 13, 2, 3, 50, 99, 1, 4]
    for dtype in ("float32", "bfloat16"):
        stored = load_model(quantized_models / fmt, "auto", dtype, "cpu")
        loaded = load_model(quantized_models / "source", "auto", dtype, "cpu", quantization=FORMATS[fmt])
        assert loaded.runtime.quantization is stored.runtime.quantization is FORMATS[fmt]
        assert torch.equal(loaded.forward(ids, list(range(len(ids))), None), stored.forward(ids, list(range(len(ids))), None))


def test_the_torch_forward_computes_with_the_dequantized_weights(quantized_models):
    for fmt in FORMATS:
        engine = GPT2Engine.load(quantized_models / fmt, "float32")
        ids = [3, 1, 4, 1, 5, 9, 2, 6]
        assert engine.runtime.blocks is None
        got = engine.forward(ids, list(range(len(ids))), None)
        reference = float64_logits(quantized_models / fmt, ids)
        assert (got.double() - reference).abs().max() <= 1e-4 * reference.abs().max()


@pytest.fixture(scope="module")
def quantized_run(tmp_path_factory):
    models = run_models(tmp_path_factory.mktemp("qrun"))
    root = models["root"]
    quantize.main(["--model", str(models["oracle"]), "--to", "q8_0", "--out", str(root / "oracle-q8_0")])
    quantize.main(["--model", str(models["draft"]), "--to", "q4_0", "--out", str(root / "draft-q4_0")])
    return models | {"oracle": root / "oracle-q8_0", "draft": root / "draft-q4_0", "source": models["oracle"]}


@pytest.mark.parametrize("method, extra", [
    ("speculative", ["--k", "4"]), ("tree", ["--budget", "12", "--depth", "5"]),
    ("staged", ["--budget", "16", "--widths", "4,2,1"]), ("lookup", []),
    ("staged", ["--budget", "16", "--widths", "4,2,1", "--draft-vocab", "64"]),
    ("speculative", ["--dtype", "bfloat16"]),
])
def test_every_method_with_a_quantized_pair_gives_the_quantized_oracles_plain_decoding(quantized_run, tmp_path, method,
                                                                                        extra):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"task_id": f"t{i}", "prompt": f"t{i} t{i + 3} t7"}) + "\n" for i in range(5)))
    common = ["--oracle", str(quantized_run["oracle"]), "--draft", str(quantized_run["draft"]), "--ngram",
              str(quantized_run["ngram"]), "--prompts", str(prompts), "--max-new-tokens", "20"]
    dtype = extra[1:2] if extra[:1] == ["--dtype"] else []
    base = run.main(common + ["--method", "baseline", *(["--dtype", *dtype] if dtype else []),
                              "--out", str(tmp_path / "base.jsonl")])
    spec = run.main(common + ["--method", method, *extra, "--out", str(tmp_path / "spec.jsonl")])
    assert [r["token_ids"] for r in base] == [r["token_ids"] for r in spec]
    assert sum(r["oracle_calls"] for r in spec) < sum(r["oracle_calls"] for r in base)


def test_a_draft_quantized_as_it_loads_drafts_as_its_quantized_checkpoint_and_the_output_stays_the_oracles(
        quantized_run, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"task_id": f"t{i}", "prompt": f"t{i} t{i + 3} t7"}) + "\n" for i in range(5)))
    common = ["--oracle", str(quantized_run["source"]), "--ngram", str(quantized_run["ngram"]), "--prompts",
              str(prompts), "--max-new-tokens", "20", "--no-plan"]
    base = run.main(common + ["--method", "baseline"])
    draft_16_bit = quantized_run["root"] / "draft"
    for method in ("speculative", "staged"):
        stored = run.main(common + ["--method", method, "--draft", str(quantized_run["draft"])])
        loaded = run.main(common + ["--method", method, "--draft", str(draft_16_bit), "--draft-dtype", "q4_0"])
        assert [r["token_ids"] for r in loaded] == [r["token_ids"] for r in stored] == [r["token_ids"] for r in base]
        assert [r["oracle_calls"] for r in loaded] == [r["oracle_calls"] for r in stored]  # the same draft's proposals
    capsys.readouterr()
    err = error_of(capsys, run.main, common + ["--method", "speculative", "--draft", str(quantized_run["draft"]),
                                               "--draft-dtype", "q8_0"])
    assert f"{quantized_run['draft']} is a q4_0 checkpoint already; quantize as it loads (q8_0) only a 16-bit model" in err


def test_a_quantized_oracle_is_its_own_model(quantized_run, tmp_path):
    """The Q8_0 oracle's greedy text is its own: it need not be the 16-bit model's, and decoding never mixes them."""
    quantized = load_model(quantized_run["oracle"], "auto", "float32", "cpu")
    source = load_model(quantized_run["source"], "auto", "float32", "cpu")
    ids = [5, 8, 13]
    a = quantized.forward(ids, [0, 1, 2], None)
    b = source.forward(ids, [0, 1, 2], None)
    assert not torch.equal(a, b)
    assert (a - b).abs().max() < 0.05 * b.abs().max()  # 8-bit blocks: close to the source, not equal


def test_quantize_refuses_bad_input_in_one_line_and_writes_nothing(quantized_run, tmp_path, capsys):
    oracle = str(quantized_run["oracle"])
    assert "quantized already (q8_0)" in error_of(capsys, quantize.main, ["--model", oracle, "--to", "q4_0", "--out",
                                                                         str(tmp_path / "twice")])
    assert not (tmp_path / "twice").exists()
    assert "already holds a model" in error_of(capsys, quantize.main, ["--model", str(quantized_run["source"]), "--to",
                                                                      "q8_0", "--out", oracle])
    damaged = tmp_path / "damaged"
    shutil.copytree(oracle, damaged)
    from safetensors.torch import load_file, save_file
    tensors = load_file(damaged / QUANTIZED_FILE)
    tensors["h.0.mlp.c_fc.weight.scales"] = tensors["h.0.mlp.c_fc.weight.scales"][:, :-1].contiguous()
    save_file(tensors, damaged / QUANTIZED_FILE)
    assert "h.0.mlp.c_fc.weight: q8_0 needs float16 scales" in error_of(capsys, run.main, ["--oracle", str(damaged),
                                                                                          "--prompt", "t1"])
    del tensors["h.1.attn.c_proj.weight.scales"], tensors["h.1.attn.c_proj.weight.quants"]
    tensors["h.0.mlp.c_fc.weight.scales"] = load_file(quantized_run["oracle"] / QUANTIZED_FILE)["h.0.mlp.c_fc.weight.scales"]
    save_file(tensors, damaged / QUANTIZED_FILE)
    assert "without quantized h.1.attn.c_proj.weight" in error_of(capsys, run.main, ["--oracle", str(damaged), "--prompt",
                                                                                    "t1"])
    config = json.loads((damaged / "config.json").read_text())
    (damaged / "config.json").write_text(json.dumps(config | {"staged_quantization": {"format": "q5_1", "block_size": 32}}))
    assert "declares staged_quantization" in error_of(capsys, run.main, ["--oracle", str(damaged), "--prompt", "t1"])
    assert f"{oracle} is a q8_0 checkpoint, which runs on the lean engine" in error_of(
        capsys, run.main, ["--oracle", oracle, "--backend", "hf", "--prompt", "t1"])
    source, draft = str(quantized_run["source"]), quantized_run["root"] / "draft"
    assert f"{draft} quantized to q8_0 as it loads runs on the lean engine" in error_of(capsys, run.main, [
        "--oracle", source, "--draft", str(draft), "--draft-dtype", "q8_0", "--method", "speculative", "--backend", "hf",
        "--prompt", "t1"])


def test_quantize_copies_what_a_model_directory_holds_besides_its_weights(quantized_run):
    draft = quantized_run["draft"]
    assert (draft / "token_counts.npy").is_file() and (draft / "tokenizer.json").is_file()
    assert not (draft / "model.safetensors").exists()
    report = json.loads((draft / quantize.REPORT).read_text())
    assert report["format"] == "q4_0" and report["bits_a_weight"] == Q4_0.bits == 4.5 and Q8_0.bits == 8.5


def test_the_api_loads_a_quantized_pair_as_it_is(quantized_run):
    from decode import SpeculativeDecoder

    pair = SpeculativeDecoder.from_pretrained(quantized_run["oracle"], quantized_run["draft"], method="speculative", k=4,
                                              dtype="float32")
    alone = SpeculativeDecoder.from_pretrained(quantized_run["oracle"], method="baseline", dtype="float32")
    prompt = "t3 t9 t27"
    assert pair.generate(prompt, max_new_tokens=16).token_ids == alone.generate(prompt, max_new_tokens=16).token_ids


def test_a_projection_prices_an_oracle_in_the_planned_oracles_block_format():
    from decode.planning.costs import random_gpt2

    for fmt in FORMATS.values():
        model = random_gpt2(2, 64, 300, "float32", "cpu", n_positions=64, quantization=fmt)
        assert model.runtime.quantization is fmt and model.runtime.weight_bytes == fmt.bits / 8
        assert model.forward([1, 2, 3], [0, 1, 2], None).shape == (3, 300)


def test_without_the_quantized_instructions_a_model_runs_in_torch_and_says_so_in_a_line(quantized_models, monkeypatch,
                                                                                        caplog):
    module = native.forward_module(torch.float32)
    if module is None:
        pytest.skip("no C++ forward for this CPU")

    class Without:  # this build's forward, on a CPU without the quantized products' instructions
        def __getattr__(self, name):
            return (lambda: False) if name == "quantized_supported" else getattr(module, name)

    monkeypatch.setattr(native, "forward_module", lambda dtype: Without())
    native.note_once.cache_clear()
    engine = GPT2Engine.load(quantized_models / "q8_0", "float32", native_blocks=True)
    assert engine.runtime.blocks is None
    assert [r.getMessage() for r in caplog.records if "quantized products' instructions" in r.getMessage()]
    ids = [3, 1, 4, 1, 5]
    reference = float64_logits(quantized_models / "q8_0", ids)
    assert (engine.forward(ids, list(range(5)), None).double() - reference).abs().max() <= 1e-4 * reference.abs().max()


def test_on_a_gpu_a_quantized_model_says_in_a_line_that_it_runs_dequantized(caplog):
    from decode.models.runtime import CudaRuntime

    native.note_once.cache_clear()
    CudaRuntime(torch.device("cuda"), torch.bfloat16, Q8_0)
    assert [r.getMessage() for r in caplog.records if "q8_0 model runs on a GPU dequantized to bfloat16" in r.getMessage()]


def test_quantizing_a_run_writes_its_oracle_and_draft_and_says_how_to_plan_for_them(tmp_path, capsys):
    run_models(tmp_path)
    quantize.main(["--run", str(tmp_path), "--to", "q8_0", "--eval-tokens", "0"])
    said = capsys.readouterr().out
    for name in ("oracle", "draft"):
        assert f"{name}: {tmp_path / name} -> {tmp_path / f'{name}-q8_0'} (q8_0" in said
        assert (tmp_path / f"{name}-q8_0" / "quantized.safetensors").is_file()
    assert (f"python -m decode.plan --run {tmp_path} --oracle {tmp_path / 'oracle-q8_0'} --draft {tmp_path / 'draft-q8_0'} "
            f"--out {tmp_path / 'plan-q8_0.json'}") in said
    assert (f"python -m decode.plan --run {tmp_path} --draft {tmp_path / 'draft-q8_0'} "
            f"--out {tmp_path / 'plan-draft-q8_0.json'}") in said
