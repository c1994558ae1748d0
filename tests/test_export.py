"""The GGUF export: both models written under llama.cpp's names, nothing lost on a refusal, and llama.cpp decoding the
exported oracle to our own greedy tokens."""
import json
import urllib.request

import pytest
from decode_models import PROMPTS, tiny_llama

from decode import SpeculativeDecoder
from decode.benchmarking import llama_server, peers
from decode.cli import bench, export
from decode.errors import InputError


def test_export_writes_the_oracle_and_the_draft_and_refuses_to_replace_them(bpe_run, tmp_path, capsys):
    gguf = pytest.importorskip("gguf")
    out = tmp_path / "gguf"
    oracle, draft = export.main(["--run", str(bpe_run["run"]), "--out", str(out)])
    assert (oracle.name, draft.name) == ("oracle.gguf", "draft.gguf")
    reader = gguf.GGUFReader(oracle)
    field = lambda key: reader.fields[key].contents()
    assert field("general.architecture") == "gpt2" and field("tokenizer.ggml.model") == "gpt2"
    vocab_size = len(bpe_run["tokenizer"])
    assert len(field("tokenizer.ggml.tokens")) == vocab_size and field("tokenizer.ggml.eos_token_id") == bpe_run["tokenizer"].eos_token_id
    shapes = {t.name: tuple(int(n) for n in t.shape) for t in reader.tensors}  # ggml's order: columns first
    assert shapes["token_embd.weight"] == shapes["output.weight"] == (32, vocab_size)
    assert shapes["blk.0.attn_qkv.weight"] == (32, 96) and shapes["blk.0.ffn_down.weight"] == (128, 32)
    before = oracle.read_bytes()
    with pytest.raises(SystemExit) as refused:
        export.main(["--run", str(bpe_run["run"]), "--out", str(out), "--dtype", "bfloat16"])
    assert refused.value.code == 2 and "--overwrite" in capsys.readouterr().err and oracle.read_bytes() == before
    bf16, _ = export.main(["--run", str(bpe_run["run"]), "--out", str(out), "--dtype", "bfloat16", "--overwrite"])
    assert bf16.stat().st_size < len(before)


def test_llama_cpp_decodes_the_exported_oracle_to_our_greedy_tokens(bpe_run, tmp_path):
    pytest.importorskip("gguf")
    llama_cpp = pytest.importorskip("llama_cpp")
    import numpy as np

    oracle, _ = export.main(["--run", str(bpe_run["run"]), "--out", str(tmp_path)])
    ours = SpeculativeDecoder.from_run(bpe_run["run"], method="baseline", dtype="float32", token_healing=False)
    llm = llama_cpp.Llama(model_path=str(oracle), n_ctx=128, n_threads=2, logits_all=True, verbose=False)
    for prompt in PROMPTS[:4]:
        ids = ours.tokenizer(prompt, add_special_tokens=False).input_ids
        expected = ours.generate(ids, max_new_tokens=24).token_ids
        llm.reset()
        llm.eval(ids)
        got = []
        while len(got) < len(expected):
            got.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
            llm.eval(got[-1:])
        assert got == expected, prompt


def bench_llamacpp(bpe_run, *extra) -> dict:
    return bench.main(["--run", str(bpe_run["run"]), "--prompts", str(bpe_run["prompts"]), "--dtype", "float32",
                       "--max-new-tokens", "16", "--methods", "baseline,llamacpp,llamacpp-lookup", *extra])["summary"]


def test_bench_runs_llama_cpp_as_a_peer_to_our_own_greedy_tokens_and_samples_with_it(bpe_run):
    pytest.importorskip("gguf")
    pytest.importorskip("llama_cpp")
    summary = bench_llamacpp(bpe_run)
    prompts = summary["baseline"]["same_output"]["identical"]
    for name in ("llamacpp", "llamacpp-lookup"):
        same = summary[name]["same_output"]
        assert same["identical"] + len(same["near_ties"]) == prompts and not same["differences"], name
    assert summary["llamacpp"]["tokens_per_oracle_call"] == 1
    assert summary["llamacpp-lookup"]["tokens_per_oracle_call"] >= 1
    sampled = bench_llamacpp(bpe_run, "--temperature", "1", "--top-k", "50")
    assert sampled["llamacpp"]["tokens_per_oracle_call"] == 1 and sampled["llamacpp-lookup"]["tokens"] > 0


def test_bench_without_llama_cpp_skips_its_peers_with_a_line_or_refuses_them_when_named(bpe_run, monkeypatch, capsys):
    monkeypatch.setattr(bench, "llamacpp_installed", lambda: False)
    with pytest.raises(SystemExit) as refused:
        bench_llamacpp(bpe_run)
    assert refused.value.code == 2 and peers.LLAMACPP_MISSING in capsys.readouterr().err
    known, names, _ = bench.parse(["--run", str(bpe_run["run"])])
    assert not set(names) & set(peers.LLAMACPP_PEERS)
    skipped = [line for line in capsys.readouterr().out.splitlines() if line.startswith("skipping llamacpp, ")]
    assert skipped == [f"skipping llamacpp, llamacpp-lookup: {peers.LLAMACPP_MISSING}"]


def test_a_shaped_checkpoint_has_the_shape_and_the_tokenizers_vocabulary_decodes_and_refuses_what_it_did_not_write(
        bpe_run, tmp_path, capsys):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from decode.cli import shaped
    from decode.models.engine import GPT2Engine

    out = shaped.main(["--shape", "2,128,50257", "--tokenizer", str(bpe_run["run"] / "tokenizer"),
                       "--out", str(tmp_path / "shaped"), "--dtype", "float32"])
    config = AutoConfig.from_pretrained(out)
    vocab = len(bpe_run["tokenizer"])
    assert (config.n_layer, config.n_embd, config.n_head, config.vocab_size) == (2, 128, 2, vocab)
    assert config.random_weights and "Its tokens are noise" in (out / "README.md").read_text()
    assert f"vocabulary {vocab} (the tokenizer's)" in capsys.readouterr().out
    ours = SpeculativeDecoder.from_run(None, oracle=out, method="baseline", dtype="float32", token_healing=False)
    ids = ours.tokenizer(PROMPTS[0], add_special_tokens=False).input_ids
    hf = AutoModelForCausalLM.from_pretrained(out).eval()  # the same weights as transformers reads them
    assert ours.generate(PROMPTS[0], max_new_tokens=8).token_ids == hf.generate(
        torch.tensor([ids]), max_new_tokens=8, do_sample=False)[0, len(ids):].tolist()
    assert GPT2Engine.load(out).vocab_size == vocab
    for bad in (["--shape", "gpt2-huge"], ["--shape", "2,100,50"]):
        with pytest.raises(SystemExit) as refused:
            shaped.main(bad + ["--tokenizer", str(bpe_run["run"] / "tokenizer"), "--out", str(tmp_path / "x")])
        assert refused.value.code == 2 and "--shape" in capsys.readouterr().err and not (tmp_path / "x").exists()
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "mine.txt").write_text("keep")
    with pytest.raises(SystemExit) as refused:
        shaped.main(["--shape", "2,128,5", "--tokenizer", str(bpe_run["run"] / "tokenizer"), "--out", str(tmp_path / "notes")])
    assert refused.value.code == 2 and (tmp_path / "notes" / "mine.txt").read_text() == "keep"
    with pytest.raises(SystemExit) as refused:
        shaped.main(["--shape", "2,128,5", "--tokenizer", str(bpe_run["run"] / "tokenizer"), "--out", str(out)])
    assert refused.value.code == 2 and "--overwrite" in capsys.readouterr().err


def llama_quantize():
    """llama.cpp's own quantizer, where it is built: LLAMA_QUANTIZE, or llama-quantize beside LLAMA_SERVER or on PATH."""
    import os
    import shutil
    from pathlib import Path

    named = os.environ.get("LLAMA_QUANTIZE")
    server = os.environ.get("LLAMA_SERVER")
    beside = Path(server).with_name("llama-quantize") if server else None
    return named or (str(beside) if beside and beside.is_file() else None) or shutil.which("llama-quantize")


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
def test_a_quantized_models_gguf_holds_the_blocks_the_engine_computes_with_and_llamacpps_quantizer_makes(bpe_run,
                                                                                                        tmp_path, fmt,
                                                                                                        capsys):
    gguf = pytest.importorskip("gguf")
    import subprocess

    import numpy as np

    from decode.cli import quantize
    from decode.models.pretrained import load_safetensors
    from decode.models.quantized import FORMATS, split_checkpoint

    quantized = tmp_path / f"oracle-{fmt}"
    quantize.main(["--model", str(bpe_run["run"] / "oracle"), "--to", fmt, "--out", str(quantized), "--data",
                   str(bpe_run["run"] / "data"), "--eval-tokens", "2000"])
    assert "perplexity on " in capsys.readouterr().out
    [ours] = export.main(["--oracle", str(quantized), "--out", str(tmp_path / "ours")])
    _, matrices = split_checkpoint(load_safetensors(quantized), FORMATS[fmt], quantized)
    names = {"blk.0.attn_qkv.weight": "h.0.attn.c_attn.weight", "blk.1.ffn_down.weight": "h.1.mlp.c_proj.weight",
             "token_embd.weight": "wte.weight"}
    tensors = {t.name: t for t in gguf.GGUFReader(ours).tensors}
    for theirs, name in names.items():
        assert tensors[theirs].tensor_type == gguf.GGMLQuantizationType[fmt.upper()]
        assert np.array_equal(np.asarray(tensors[theirs].data).reshape(-1), matrices[name].block_bytes().numpy().reshape(-1))
    # the 16-bit run exported in the format (the draft alone: --draft-dtype): the same tensors, quantized on the way
    oracle, draft = export.main(["--run", str(bpe_run["run"]), "--dtype", fmt, "--out", str(tmp_path / "direct")])
    direct = {t.name: t for t in gguf.GGUFReader(oracle).tensors}
    assert direct.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert direct[name].tensor_type == tensor.tensor_type and np.array_equal(direct[name].data, tensor.data), name
    _, draft_alone = export.main(["--run", str(bpe_run["run"]), "--draft-dtype", fmt, "--out", str(tmp_path / "draft")])
    types = lambda path: {t.tensor_type for t in gguf.GGUFReader(path).tensors if t.name.endswith("attn_qkv.weight")}
    assert types(draft_alone) == types(draft) == {gguf.GGMLQuantizationType[fmt.upper()]}
    assert types(tmp_path / "draft" / "oracle.gguf") == {gguf.GGMLQuantizationType.F32}
    tool = llama_quantize()
    if tool is None:
        pytest.skip("llama-quantize not built here (LLAMA_QUANTIZE names it)")
    full, _ = export.main(["--run", str(bpe_run["run"]), "--out", str(tmp_path / "f32")])
    made = tmp_path / "theirs.gguf"
    subprocess.run([tool, str(full), str(made), fmt.upper()], check=True, capture_output=True)
    theirs = {t.name: t for t in gguf.GGUFReader(made).tensors}
    for name in ("blk.0.attn_qkv.weight", "blk.0.ffn_up.weight", "blk.1.attn_output.weight", "blk.1.ffn_down.weight"):
        assert np.array_equal(np.asarray(theirs[name].data), np.asarray(tensors[name].data)), name


# Text that each way of splitting splits differently: digit runs, contractions, runs of spaces and newlines, letters
# outside ASCII
SPLIT_TEXT = "Don't split 12345 digits,\n\n  nor   spaces; it's 3.14 or 2026-12-03!\tÉté 你好 x=[1, 22, 333]\n    return y\n"


def bpe_splitting(name: str):
    """A byte-level BPE trained here whose pre-tokenizer is the real one of `name`'s tokenizers (tokenizers' own
    classes, as the hub's tokenizer.json files serialize them), or a whitespace split."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from decode.models.gguf_export import LLAMA3_REGEX, QWEN2_REGEX

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=name in ("gpt-2", "smollm"))
    split = {"llama-bpe": LLAMA3_REGEX, "qwen2": QWEN2_REGEX}
    steps = {"gpt-2": [byte_level], "smollm": [pre_tokenizers.Digits(individual_digits=True), byte_level],
             "whitespace": [pre_tokenizers.Whitespace()]}.get(name) or [
        pre_tokenizers.Split(Regex(split[name]), behavior="isolated", invert=False), byte_level]
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = steps[0] if len(steps) == 1 else pre_tokenizers.Sequence(steps)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator([SPLIT_TEXT, *PROMPTS] * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>")


def exported_with(name: str, tmp_path):
    from decode.models.gguf_export import write_gguf

    tokenizer = bpe_splitting(name)
    oracle = tiny_llama(tmp_path / "oracle", "qwen2" if name == "qwen2" else "llama", vocab_size=len(tokenizer),
                        tokenizer=tokenizer)
    write_gguf(oracle, tmp_path / "oracle.gguf")
    return tokenizer, tmp_path / "oracle.gguf"


@pytest.mark.parametrize("name", ["gpt-2", "llama-bpe", "qwen2", "smollm"])
def test_the_gguf_names_the_way_the_tokenizer_splits_text_as_llama_cpp_knows_it(name, tmp_path):
    gguf = pytest.importorskip("gguf")
    _, path = exported_with(name, tmp_path)
    assert gguf.GGUFReader(path).fields["tokenizer.ggml.pre"].contents() == name


def test_a_tokenizer_that_splits_text_in_a_way_llama_cpp_does_not_name_is_refused_in_one_line(tmp_path):
    pytest.importorskip("gguf")
    with pytest.raises(InputError, match="pre-tokenizer Whitespace\\); convert this model with llama.cpp's convert_hf_to_gguf.py"):
        exported_with("whitespace", tmp_path)
    assert not (tmp_path / "oracle.gguf").exists()


@pytest.mark.processes
@pytest.mark.parametrize("name", ["gpt-2", "llama-bpe", "qwen2", "smollm"])
def test_llama_server_tokenizes_text_as_the_exported_tokenizer_does(name, tmp_path):
    pytest.importorskip("gguf")
    if llama_server.server_binary() is None:
        pytest.skip(f"no llama-server here: {llama_server.missing_reason()}")
    tokenizer, path = exported_with(name, tmp_path)
    server = llama_server.LlamaServer({"oracle": path}, [], threads=1, context=256)
    try:
        request = urllib.request.Request(f"http://127.0.0.1:{server.port}/tokenize",
                                         json.dumps({"content": SPLIT_TEXT, "add_special": False}).encode(),
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as reply:
            theirs = json.loads(reply.read())["tokens"]
    finally:
        server.close()
    assert theirs == tokenizer(SPLIT_TEXT, add_special_tokens=False).input_ids
