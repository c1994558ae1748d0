"""The vocabularies users' models ship with: output rows padded past the tokenizer's tokens, start tokens the
tokenizer puts before a text, stop tokens the model's generation config lists, and token ids past 65,535 from the
data to the decoded text."""
import json
import shutil
import threading

import numpy as np
import pytest
import torch
from decode_models import tiny_gpt2
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, pre_tokenizers, processors
from tokenizers import models as tokenizer_models
from transformers import PreTrainedTokenizerFast

from data import prepare
from data.shards import open_split
from decode import SpeculativeDecoder
from decode.cli import quantize, run
from decode.models.successors import SuccessorTable
from decode.sampling import GREEDY
from decode.serving.app import create_app
from ngram import build_katz
from train import distill_draft
from train.continuations import POOL_FILE

PADDING = 64  # output rows past the 97 tokens of decode_models' word-level tokenizer


def padded(model_dir, out, rows: int):
    """`model_dir`'s checkpoint with `rows` output rows past its tokenizer's: each a large multiple of a real row, so
    that its logit, where that row's is positive, wins over every token's."""
    weights = load_file(model_dir / "model.safetensors")
    name = next(k for k in weights if k.endswith("wte.weight"))
    wte = weights[name]
    weights[name] = torch.cat([wte, 50 * wte[torch.arange(rows) % wte.shape[0]]])
    out.mkdir()
    for f in model_dir.iterdir():
        if f.name != "model.safetensors":
            (out / f.name).write_bytes(f.read_bytes())
    config = (out / "config.json").read_text().replace(f'"vocab_size": {wte.shape[0]}', f'"vocab_size": {wte.shape[0] + rows}')
    (out / "config.json").write_text(config)
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("padded")
    oracle = tiny_gpt2(root / "oracle", seed=0, n_positions=64)
    draft = tiny_gpt2(root / "draft", seed=1, noise_from=oracle, noise=0.005, n_positions=64)
    return {"oracle": oracle, "padded_oracle": padded(oracle, root / "padded_oracle", PADDING),
            "draft": draft, "padded_draft": padded(draft, root / "padded_draft", 2 * PADDING)}


@pytest.mark.parametrize("backend, weights", [("lean", None), ("hf", None), ("lean", "q8_0")])
def test_padded_output_rows_are_never_decoded_and_the_model_decodes_as_without_them(models, tmp_path, backend, weights):
    unpadded, padded_oracle = models["oracle"], models["padded_oracle"]
    if weights is not None:
        quantize.main(["--model", str(unpadded), "--to", weights, "--out", str(tmp_path / "plain")])
        quantize.main(["--model", str(padded_oracle), "--to", weights, "--out", str(tmp_path / "padded")])
        unpadded, padded_oracle = tmp_path / "plain", tmp_path / "padded"
    plain = SpeculativeDecoder.from_pretrained(unpadded, method="baseline", backend=backend, dtype="float32")
    oracle = SpeculativeDecoder.from_pretrained(padded_oracle, method="baseline", backend=backend, dtype="float32")
    assert oracle.decoder.oracle.vocab_size == 97
    for prompt in ("t3 t9", "t40 t2 t17", "t88"):
        expected = plain.generate(prompt, max_new_tokens=24).token_ids
        assert oracle.generate(prompt, max_new_tokens=24).token_ids == expected
        for seed in range(3):  # sampled: the same draws over the same 97 tokens
            sampled = oracle.generate(prompt, max_new_tokens=24, do_sample=True, seed=seed).token_ids
            assert sampled == plain.generate(prompt, max_new_tokens=24, do_sample=True, seed=seed).token_ids
            assert max(sampled) < 97


def test_a_draft_padded_otherwise_than_its_oracle_drafts_for_it_exactly(models):
    baseline = SpeculativeDecoder.from_pretrained(models["padded_oracle"], method="baseline", dtype="float32")
    for draft in ("draft", "padded_draft"):
        speculative = SpeculativeDecoder.from_pretrained(models["padded_oracle"], models[draft], method="speculative",
                                                         dtype="float32")
        for prompt in ("t3 t9", "t40 t2 t17"):
            assert (speculative.generate(prompt, max_new_tokens=24).token_ids
                    == baseline.generate(prompt, max_new_tokens=24).token_ids), draft


def test_a_draft_distilled_from_a_padded_teacher_takes_its_output_rows(trained_oracle_run, tmp_path):
    run, _ = trained_oracle_run
    teacher = padded(run / "oracle", tmp_path / "teacher", PADDING)
    distill_draft.main(["--data", str(run / "data"), "--teacher", str(teacher), "--n-embd", "32", "--max-steps", "12",
                        "--out", str(tmp_path / "draft")])
    rows = lambda model: load_file(model / "model.safetensors")["transformer.wte.weight"].shape[0]
    assert rows(tmp_path / "draft") == rows(teacher) == rows(run / "oracle") + PADDING
    exact = SpeculativeDecoder.from_pretrained(teacher, tmp_path / "draft", method="speculative", dtype="float32")
    baseline = SpeculativeDecoder.from_pretrained(teacher, method="baseline", dtype="float32")
    assert exact.generate("def f(x):", max_new_tokens=16).token_ids == baseline.generate("def f(x):",
                                                                                        max_new_tokens=16).token_ids


def starting_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over t0..t95 and <s> (96) that puts <s> before every text, as Llama's puts its
    <|begin_of_text|>; t0 ends a text."""
    backend = Tokenizer(tokenizer_models.WordLevel({**{f"t{i}": i for i in range(96)}, "<s>": 96}, unk_token="t1"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 96)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="t0", unk_token="t1")


def served(decoder, body: dict) -> dict:
    from fastapi.testclient import TestClient

    app = create_app(decoder, "oracle", queue_size=4)
    worker = threading.Thread(target=app.state.worker.run, daemon=True)
    worker.start()
    try:
        answer = TestClient(app).post("/v1/completions", json=body)
    finally:
        app.state.worker.stop()
        worker.join(timeout=60)
    assert answer.status_code == 200, answer.text
    return answer.json()


def test_a_text_prompt_gets_the_start_token_its_tokenizer_adds_alike_everywhere(tmp_path, capsys):
    oracle = tiny_gpt2(tmp_path / "oracle", seed=0, n_positions=64, tokenizer=starting_tokenizer())
    decoder = SpeculativeDecoder.from_pretrained(oracle, method="baseline", dtype="float32")
    assert decoder.token_ids("t3 t9") == decoder.token_ids("<s> t3 t9") == [96, 3, 9]  # added once, not twice
    expected = decoder.generate([96, 3, 9], max_new_tokens=12)
    assert decoder.generate("t3 t9", max_new_tokens=12).token_ids == expected.token_ids
    records = run.main(["--oracle", str(oracle), "--method", "baseline", "--prompt", "t3 t9", "--max-new-tokens", "12",
                        "--dtype", "float32"])
    assert records[0]["token_ids"] == expected.token_ids
    answer = served(decoder, {"prompt": "t3 t9", "max_tokens": 12, "temperature": 0})
    assert answer["usage"]["prompt_tokens"] == 3 and answer["choices"][0]["text"] == expected.text
    plain = SpeculativeDecoder.from_pretrained(tiny_gpt2(tmp_path / "plain", seed=0), method="baseline")
    assert plain.token_ids("t3 t9") == [3, 9]  # a tokenizer that adds nothing (GPT-2's) gets nothing


def test_a_start_token_leaves_token_healing_as_it_was(bpe_run, tmp_path):
    """A byte-level BPE whose tokenizer puts <|endoftext|> before a text (as Llama 3's puts <|begin_of_text|>): a
    prompt ending in a bare newline is still healed, its start token kept."""
    plain = SpeculativeDecoder.from_run(bpe_run["run"], method="baseline", plan=None, dtype="float32")
    oracle = tmp_path / "oracle"
    shutil.copytree(bpe_run["run"] / "oracle", oracle)
    config = json.loads((oracle / "tokenizer.json").read_text())
    config["post_processor"] = json.loads(processors.TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", plain.decoder.eos_id)]).__getstate__())
    (oracle / "tokenizer.json").write_text(json.dumps(config))
    starting = SpeculativeDecoder.from_pretrained(oracle, method="baseline", dtype="float32")
    prompt = "import math\n"  # ends in a bare newline token: healed
    assert starting.token_ids(prompt) == [plain.decoder.eos_id, *plain.token_ids(prompt)]
    result = starting.generate(prompt, max_new_tokens=8)
    assert result.healed == "\n" and plain.generate(prompt, max_new_tokens=8).healed == "\n"
    assert result.token_ids == starting.generate(starting.token_ids(prompt), max_new_tokens=8).token_ids


def test_every_stop_token_of_the_generation_config_ends_the_output_in_every_method(models, tmp_path):
    oracle, draft = models["oracle"], models["draft"]
    unstopped = SpeculativeDecoder.from_pretrained(oracle, method="baseline", dtype="float32")
    tokens = unstopped.generate("t3 t9", max_new_tokens=24).token_ids
    stop = next(t for t in tokens[3:] if t != 0)  # a token the output reaches after a few others
    end = tokens.index(stop) + 1
    stopping = tmp_path / "oracle"
    stopping.mkdir()
    for f in oracle.iterdir():
        (stopping / f.name).write_bytes(f.read_bytes())
    (stopping / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, stop]}))
    for method in ("baseline", "speculative"):
        decoder = SpeculativeDecoder.from_pretrained(stopping, draft if method != "baseline" else None, method=method,
                                                     dtype="float32")
        result = decoder.generate("t3 t9", max_new_tokens=24)
        assert result.token_ids == tokens[:end] and result.finish_reason == "stop", method
        assert result.text == unstopped.tokenizer.decode(tokens[: end - 1]), method  # the stop token's text is left out
        looped = decoder.decoder(decoder.prompt("t3 t9", 24), 24, 0, GREEDY)  # the loop itself, as the bench runs it
        assert looped.tokens == tokens[:end], method


LARGE = 100_005  # tokens: <|endoftext|> (0), the words w1 .. w100003, <unk>


def large_tokenizer() -> PreTrainedTokenizerFast:
    words = {"<|endoftext|>": 0, **{f"w{i}": i for i in range(1, LARGE - 1)}, "<unk>": LARGE - 1}
    backend = Tokenizer(tokenizer_models.WordLevel(words, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>", unk_token="<unk>")


@pytest.mark.pipeline
def test_token_ids_past_65535_survive_the_data_the_distillation_the_trigram_and_decoding(tmp_path):
    """A 100,005-token vocabulary end to end: ids a uint16 would wrap are kept by data.prepare's shards, the
    distillation's teacher continuations and the trigram, and decoded exactly."""
    tokenizer = large_tokenizer()
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    rng = np.random.default_rng(0)
    cycle = [70_000, 99_999, 65_537, 100_003, 5, 131]  # a phrase the trigram learns: mostly ids past 65,535
    src = tmp_path / "src"
    src.mkdir()
    documents = []
    for i in range(40):  # each line a bare name, so that every file is Python
        ids = cycle * 3 + rng.integers(1, LARGE - 1, 30).tolist()
        documents.append(ids)
        (src / f"m{i}.py").write_text("".join(f"w{t}\n" for t in ids))
    run_dir = tmp_path / "run"
    prepare.main(["--path", str(src), "--out", str(run_dir), "--tokenizer", str(tmp_path / "tokenizer"),
                  "--num-prompts", "0", "--val-fraction", "0.2"])
    shards = [open_split(run_dir / "data", split) for split in ("train", "val")]
    assert all(shard.dtype == np.uint32 for shard in shards)
    stored = np.concatenate(shards)
    expected = np.concatenate([np.array(d + [0]) for d in documents])
    assert np.array_equal(np.bincount(stored, minlength=LARGE), np.bincount(expected, minlength=LARGE))

    oracle = tiny_gpt2(run_dir / "oracle", vocab_size=LARGE, seed=0, n_positions=64, tokenizer=tokenizer)
    distill_draft.main(["--data", str(run_dir / "data"), "--teacher", str(oracle), "--out", str(run_dir / "draft"),
                        "--n-embd", "32", "--n-layer", "1", "--seq-len", "32", "--batch-size", "2", "--max-steps", "12",
                        "--teacher-windows", "1", "--continuation-tokens", "16"])
    with np.load(run_dir / "draft-train" / POOL_FILE) as pool:
        windows = pool["windows"]
    assert windows.dtype == np.uint32 and windows[:, -16:].max() > 65_535  # the teacher's own tokens, unwrapped

    build_katz.main(["--data", str(run_dir / "data"), "--out", str(run_dir / "ngram")])
    table = SuccessorTable.load(run_dir / "ngram" / "successors.npz")
    following, _ = table.lookup(np.array([70_000, 99_999]), np.array([99_999, 65_537]))
    assert following[:, 0].tolist() == [65_537, 100_003]

    decoder = SpeculativeDecoder.from_run(run_dir, method="staged", plan=None, dtype="float32")
    baseline = SpeculativeDecoder.from_run(run_dir, method="baseline", plan=None, dtype="float32")
    assert decoder.token_ids("w70000 w99999 w65537") == [70_000, 99_999, 65_537]
    staged = decoder.generate("w70000 w99999 w65537", max_new_tokens=16)
    assert staged.token_ids == baseline.generate("w70000 w99999 w65537", max_new_tokens=16).token_ids
    assert max(staged.token_ids) > 65_535
    assert staged.text.split() == [f"w{t}" for t in staged.token_ids if t != 0]


def test_a_tokenizer_is_loaded_once_per_directory_and_again_when_its_files_change(tmp_path):
    from decode.tokenizer import load_tokenizer

    starting_tokenizer().save_pretrained(tmp_path / "tokenizer")
    first = load_tokenizer(tmp_path / "tokenizer")
    assert load_tokenizer(str(tmp_path / "tokenizer")) is first and first("t3").input_ids == [96, 3]
    large_tokenizer().save_pretrained(tmp_path / "tokenizer")  # another tokenizer in the same place
    again = load_tokenizer(tmp_path / "tokenizer")
    assert again is not first and len(again) == LARGE and again("w70000", add_special_tokens=False).input_ids == [70_000]
