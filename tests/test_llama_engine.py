"""Llama-family models (Llama, Qwen2, Mistral) on the lean engine: their logits equal transformers' to float32
rounding, in torch's forward and the C++ forward, over a prompt and a tree; every method's greedy output is their
plain decoding's; a config the engine does not implement runs on transformers' backend, said in one line."""
import json
import logging
import random

import pytest
import torch
from decode_models import tiny_llama, tiny_trigram
from native_built import random_tree
from test_native_forward import needs_cpp_forward
from transformers import AutoModelForCausalLM

from decode.cli import run
from decode.errors import InputError
from decode.models.hf_backend import HFEngine
from decode.models.llama import LlamaEngine, dequantized_checkpoint
from decode.models.loading import load_model
from decode.models.pretrained import load_safetensors
from decode.models.quantized import Q8_0, split_checkpoint
from decode.tokenizer import load_tokenizer

CONFIGS = {  # model_type, its options: each feature the engine implements, in at least one
    "llama": ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                         "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
                        "attention_bias": True, "mlp_bias": True}),
    "llama-yarn": ("llama", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}}),
    "qwen2": ("qwen2", {"tie_word_embeddings": True}),  # q/k/v biases, a tied output layer
    "mistral": ("mistral", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}, "sliding_window": None}),
}


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("backend", ["torch", "C++", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
def test_logits_equal_transformers_to_float32_rounding_over_a_prompt_and_a_tree(tmp_path, name, backend):
    """On a CPU through torch's operations and through the C++ forward; on CUDA through the CUDA graphs' buckets."""
    if backend == "C++":
        needs_cpp_forward("float32")
    model_type, options = CONFIGS[name]
    device = "cuda" if backend == "cuda" else "cpu"
    directory = tiny_llama(tmp_path / "model", model_type, **options)
    reference = AutoModelForCausalLM.from_pretrained(directory).to(device).eval()
    engine = LlamaEngine.load(directory, device=device, native_blocks=backend == "C++", cuda_graphs=backend == "cuda")
    assert (engine.runtime.blocks is not None) == (backend == "C++") and (engine.graphs is not None) == (backend == "cuda")
    prompt = torch.randint(1, 97, (40,), generator=torch.Generator().manual_seed(0)).to(device)
    with torch.no_grad():
        expected = reference(prompt[None]).logits[0]
        torch.testing.assert_close(engine.extend(prompt), expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
        tree = random_tree(random.Random(0), 12, 97)
        logits = engine.forward(tree.tokens, tree.positions(engine.length), tree.mask().to(device))
        for node in range(len(tree)):  # each node's logits: those of its path after the prompt
            path = torch.tensor([tree.tokens[i] for i in tree.path(node)], device=device)
            expected = reference(torch.cat([prompt, path])[None]).logits[0, -1]
            torch.testing.assert_close(logits[node], expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


def test_a_mistral_sliding_window_caps_the_context_where_attention_is_the_same(tmp_path):
    engine = LlamaEngine.load(tiny_llama(tmp_path / "model", "mistral", sliding_window=48))
    assert engine.max_length == 48


@pytest.fixture(scope="module")
def llama_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("llama")
    oracle = tiny_llama(root / "oracle", "llama", seed=0)
    draft = tiny_llama(root / "draft", "llama", seed=1, noise_from=oracle, noise=0.01)
    return {"oracle": oracle, "draft": draft, "ngram": tiny_trigram(root / "ngram", oracle)}


@pytest.mark.parametrize("method, extra", [
    ("speculative", ["--k", "4"]), ("tree", ["--budget", "12", "--depth", "5"]),
    ("staged", ["--budget", "16", "--widths", "4,2,1"]), ("lookup", []),
    ("staged", ["--budget", "16", "--widths", "4,2,1", "--draft-dtype", "bfloat16"]),
])
def test_every_method_on_a_llama_family_pair_gives_the_oracles_plain_decoding(llama_run, tmp_path, method, extra):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"task_id": f"t{i}", "prompt": f"t{i} t{i + 3} t7"}) + "\n" for i in range(5)))
    common = ["--oracle", str(llama_run["oracle"]), "--draft", str(llama_run["draft"]), "--ngram",
              str(llama_run["ngram"]), "--prompts", str(prompts), "--max-new-tokens", "24"]
    base = run.main(common + ["--method", "baseline", "--out", str(tmp_path / "base.jsonl")])
    spec = run.main(common + ["--method", method, *extra, "--out", str(tmp_path / "spec.jsonl")])
    assert [r["token_ids"] for r in base] == [r["token_ids"] for r in spec]
    if method != "lookup":  # (random weights repeat little of the context: lookup's exactness is what is checked)
        assert sum(r["oracle_calls"] for r in spec) < sum(r["oracle_calls"] for r in base)


def test_a_config_the_engine_does_not_implement_runs_on_transformers_said_in_one_line(tmp_path, caplog):
    directory = tiny_llama(tmp_path / "model", "llama", rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    with caplog.at_level(logging.WARNING):
        model = load_model(directory, "auto", "float32", "cpu")
    assert isinstance(model, HFEngine)
    notes = [r.getMessage() for r in caplog.records if "transformers backend" in r.getMessage()]
    assert len(notes) == 1 and "its rope type 'dynamic'" in notes[0]
    with pytest.raises(InputError, match="cannot run on the lean engine: its rope type 'dynamic'.*--backend hf"):
        load_model(directory, "lean", "float32", "cpu")
    assert isinstance(load_model(tiny_llama(tmp_path / "supported", "llama"), "auto", "float32", "cpu"), LlamaEngine)


def test_a_qwen2_directory_with_a_generic_tokenizer_reads_text_as_that_tokenizer_does(tmp_path):
    # transformers' AutoTokenizer reads it as a Qwen2Tokenizer, which splits the text otherwise (here: one token)
    directory = tiny_llama(tmp_path / "model", "qwen2")
    assert load_tokenizer(directory)("t1 t3 t7", add_special_tokens=False).input_ids == [1, 3, 7]


@pytest.mark.processes
@pytest.mark.parametrize("model_type", ["llama", "qwen2"])  # llama.cpp's "llama" (its rows reordered) and "qwen2"
def test_llama_server_decodes_the_exported_llama_family_oracle_to_our_greedy_tokens(bpe_run, tmp_path, model_type):
    from decode.benchmarking import llama_server
    from decode.cli import bench

    if llama_server.server_binary() is None:
        pytest.skip(f"no llama-server here: {llama_server.missing_reason()}")
    tokenizer = bpe_run["tokenizer"]
    # (seed 0's llama has a near tie on a byte token, whose probabilities llama-server does not give to judge it)
    oracle = tiny_llama(tmp_path / "oracle", model_type, vocab_size=len(tokenizer), tokenizer=tokenizer, seed=2)
    result = bench.main(["--oracle", str(oracle), "--prompts", str(bpe_run["prompts"]), "--limit", "4",
                         "--max-new-tokens", "16", "--dtype", "float32", "--methods", "baseline,llamacpp-server"])
    same = result["summary"]["llamacpp-server"]["same_output"]
    assert same["identical"] + len(same["near_ties"]) == 4 and not same["differences"], same


@pytest.fixture(scope="module")
def quantized_llama_run(llama_run, tmp_path_factory):
    from decode.cli import quantize

    root = tmp_path_factory.mktemp("quantized-llama")
    quantize.main(["--model", str(llama_run["oracle"]), "--to", "q8_0", "--out", str(root / "oracle-q8_0")])
    quantize.main(["--model", str(llama_run["draft"]), "--to", "q4_0", "--out", str(root / "draft-q4_0")])
    return llama_run | {"oracle": root / "oracle-q8_0", "draft": root / "draft-q4_0", "source": llama_run["oracle"]}


@pytest.mark.parametrize("method, extra", [("speculative", ["--k", "4"]), ("staged", ["--budget", "16", "--widths", "4,2,1"])])
def test_every_method_on_a_quantized_llama_family_pair_gives_the_quantized_oracles_plain_decoding(quantized_llama_run,
                                                                                                 tmp_path, method, extra):
    test_every_method_on_a_llama_family_pair_gives_the_oracles_plain_decoding(quantized_llama_run, tmp_path, method, extra)


def test_a_llama_family_model_quantized_as_it_loads_is_its_quantized_checkpoint(quantized_llama_run):
    stored = load_model(quantized_llama_run["oracle"], "lean", "float32", "cpu")
    loaded = load_model(quantized_llama_run["source"], "lean", "float32", "cpu", quantization=Q8_0)
    prompt = torch.randint(1, 97, (30,), generator=torch.Generator().manual_seed(3))
    assert loaded.runtime.quantization is Q8_0 and torch.equal(loaded.extend(prompt), stored.extend(prompt))


def test_a_quantized_llama_family_model_computes_in_cpp_what_torch_computes_dequantized(quantized_llama_run):
    needs_cpp_forward("float32")
    if not load_model(quantized_llama_run["oracle"], "lean", "float32", "cpu").runtime.blocks:
        pytest.skip("this CPU lacks the quantized products' instructions")
    in_cpp, in_torch, source = (LlamaEngine.load(directory, native_blocks=cpp) for directory, cpp in (
        (quantized_llama_run["oracle"], True), (quantized_llama_run["oracle"], False), (quantized_llama_run["source"], False)))
    prompt = torch.randint(1, 97, (30,), generator=torch.Generator().manual_seed(3))
    got, dequantized, sixteen_bit = (model.extend(prompt) for model in (in_cpp, in_torch, source))
    scale = dequantized.abs().max()
    # the C++ products also round each row's activations to int8 blocks, as llama.cpp's do: the dequantized model's
    # logits to within that rounding
    assert (got - dequantized).abs().max() < 0.05 * scale
    assert not torch.equal(dequantized, sixteen_bit) and (dequantized - sixteen_bit).abs().max() < 0.1 * scale


def test_loading_a_quantized_llama_family_model_takes_each_block_matrix_out_of_the_checkpoint_as_it_packs_it(
        quantized_llama_run):
    """A matrix the C++ has packed must be held nowhere else, so that a load's memory never holds the checkpoint's
    matrices beside their packed copies (twice the weights at its peak)."""
    needs_cpp_forward("float32")
    directory = quantized_llama_run["oracle"]
    config, fmt = json.loads((directory / "config.json").read_text()), Q8_0
    dense, quantized = split_checkpoint(load_safetensors(directory), fmt, directory)
    before = len(quantized)
    engine = LlamaEngine.build(config, dense, native_blocks=True, quantized=quantized,
                               reload=lambda: dequantized_checkpoint(load_safetensors(directory), fmt, directory))
    if not engine.runtime.blocks:
        pytest.skip("this CPU lacks the quantized products' instructions")
    assert before > 2 and set(quantized) <= {"embed_tokens.weight", "lm_head.weight"}  # the output layer's, kept


@pytest.mark.processes
def test_llama_server_decodes_the_exported_quantized_llama_oracle_to_our_greedy_tokens(bpe_run, tmp_path):
    from decode.benchmarking import llama_server
    from decode.cli import bench, quantize

    if llama_server.server_binary() is None:
        pytest.skip(f"no llama-server here: {llama_server.missing_reason()}")
    tokenizer = bpe_run["tokenizer"]
    source = tiny_llama(tmp_path / "oracle", "llama", vocab_size=len(tokenizer), tokenizer=tokenizer, seed=2)
    quantize.main(["--model", str(source), "--to", "q8_0", "--out", str(tmp_path / "oracle-q8_0")])
    result = bench.main(["--oracle", str(tmp_path / "oracle-q8_0"), "--prompts", str(bpe_run["prompts"]), "--limit", "4",
                         "--max-new-tokens", "16", "--dtype", "float32", "--methods", "baseline,llamacpp-server"])
    same = result["summary"]["llamacpp-server"]["same_output"]
    assert same["identical"] + len(same["near_ties"]) == 4 and not same["differences"], same
