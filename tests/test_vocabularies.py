"""The vocabularies users' models ship with: output rows padded past the tokenizer's tokens, and token ids past
65,535 from the data to the decoded text."""
import pytest
import torch
from decode_models import tiny_gpt2
from safetensors.torch import load_file, save_file

from decode import SpeculativeDecoder
from decode.cli import quantize
from train import distill_draft

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
