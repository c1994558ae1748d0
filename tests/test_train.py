"""Training: the oracle's loss falls, distillation raises agreement, runs resume to the same weights, saved models load
with transformers' auto classes, and bad settings are one-line errors."""
import json
import os
import signal

import numpy as np
import pytest
import torch
from train_runs import assert_resumed_distillation_matches, assert_same_weights, error_of, prepared_run
from transformers import AutoModelForCausalLM, AutoTokenizer

from data.shards import open_split
from decode import machine
from decode.models.loading import TOKEN_COUNTS
from decode.models.pretrained import FUSED_GELU
from train import distill_draft, finetune_oracle, loop
from train.work_dir import CHECKPOINT_PREFIX


@pytest.fixture(scope="module")
def run(trained_oracle_run):
    return trained_oracle_run


def test_oracle_loss_decreases_on_a_repetitive_corpus(run):
    _, metrics = run
    assert metrics["val_loss"] < 0.5 * metrics["val_loss_initial"]


def test_resumed_run_ends_with_the_same_weights(run, tmp_path):
    data = str(run[0] / "data")
    finetune_oracle.main(["--data", data, "--out", str(tmp_path / "whole"), "--max-steps", "20"])
    part = ["--data", data, "--out", str(tmp_path / "parts"), "--max-steps", "20"]
    stopped = finetune_oracle.main(part + ["--stop-after-steps", "8"])
    assert stopped["step"] == 8 and not (tmp_path / "parts").exists()
    finetune_oracle.main(part + ["--resume"])
    assert finetune_oracle.main(part + ["--overwrite", "--max-steps", "12"])["step"] == 12
    finetune_oracle.main(part + ["--overwrite", "--stop-after-steps", "8"])
    finetune_oracle.main(part + ["--resume"])
    assert_same_weights(tmp_path / "whole", tmp_path / "parts")


@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_during_training_saves_the_step_it_reached_and_resume_ends_with_the_same_weights(
        run, tmp_path, monkeypatch, capsys, signum, code):
    data = str(run[0] / "data")
    finetune_oracle.main(["--data", data, "--out", str(tmp_path / "whole"), "--max-steps", "12"])
    capsys.readouterr()

    class SignalledAtStep5(loop.tqdm):  # the signal arrives as step 5 is counted, after its weights changed
        def update(self, n=1):
            super().update(n)
            if self.n == 5:
                os.kill(os.getpid(), signum)

    monkeypatch.setattr(loop, "tqdm", SignalledAtStep5)
    part = ["--data", data, "--out", str(tmp_path / "parts"), "--max-steps", "12", "--save-every", "2",
            "--keep-checkpoints", "1"]
    with pytest.raises(SystemExit) as stopped:
        finetune_oracle.main(part)
    assert stopped.value.code == code
    saved = tmp_path / "parts-train" / "checkpoints" / f"{CHECKPOINT_PREFIX}0000005"
    err = capsys.readouterr().err
    assert saved.is_dir() and "stopped at step 5 of 12" in err and "--resume" in err and str(saved) in err
    assert f"{CHECKPOINT_PREFIX}0000004" not in err  # removed by --keep-checkpoints 1, so not named as written
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the handlers are back
    monkeypatch.undo()
    assert finetune_oracle.main(part + ["--resume"])["step"] == 12
    assert_same_weights(tmp_path / "whole", tmp_path / "parts")


def test_distillation_raises_agreement_with_the_teacher(run, tmp_path):
    data, teacher = str(run[0] / "data"), str(run[0] / "oracle")
    common = ["--data", data, "--teacher", teacher, "--n-embd", "32", "--max-steps", "150"]
    distilled = distill_draft.main(common + ["--out", str(tmp_path / "distilled"), "--kd-weight", "1.0"])
    plain = distill_draft.main(common + ["--out", str(tmp_path / "plain"), "--kd-weight", "0.0"])
    assert distilled["top1_agreement"] > plain["top1_agreement"] + 0.02
    assert distilled["expected_acceptance"] > plain["expected_acceptance"]


def test_divergences_match_their_definitions():
    p = torch.tensor([[0.7, 0.2, 0.1], [0.25, 0.25, 0.5]])
    q = torch.tensor([[0.5, 0.3, 0.2], [0.25, 0.5, 0.25]])
    forward = (p * (p / q).log()).sum(-1).mean()
    reverse = (q * (q / p).log()).sum(-1).mean()
    tv = 0.5 * (p - q).abs().sum(-1).mean()
    for kind, expected in (("forward", forward), ("reverse", reverse), ("tv", tv)):
        assert torch.allclose(distill_draft.divergence(q.log(), p.log(), kind), expected), kind
        assert distill_draft.divergence(p.log(), p.log(), kind).abs() < 1e-6
    assert not torch.allclose(forward, reverse)


def test_saved_models_load_with_auto_classes_and_generate(run, tmp_path):
    root, _ = run
    distill_draft.main(["--data", str(root / "data"), "--teacher", str(root / "oracle"), "--out", str(tmp_path / "draft")])
    for directory in (root / "oracle", tmp_path / "draft"):
        model = AutoModelForCausalLM.from_pretrained(directory)
        tokenizer = AutoTokenizer.from_pretrained(directory)
        prompt = tokenizer("def scale_1(values", return_tensors="pt").input_ids
        out = model.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.eos_token_id)
        assert out.shape[1] > prompt.shape[1]
        assert isinstance(tokenizer.decode(out[0]), str)
        assert json.loads((directory / "training_args.json").read_text())["max_steps"] == 60
        assert model.config.activation_function == FUSED_GELU  # GPT-2's GELU in torch's fused kernel
        counts = np.load(directory / TOKEN_COUNTS)  # what a shortlist of the model's output tokens is chosen by
        assert counts.shape == (model.config.vocab_size,) and counts.sum() == len(open_split(root / "data", "train"))
        assert counts[tokenizer.eos_token_id] == sum(open_split(root / "data", "train") == tokenizer.eos_token_id)
    metrics = json.loads((tmp_path / "draft" / "metrics.json").read_text())
    assert metrics["teacher"] == str((root / "oracle").resolve()) and 0 <= metrics["top1_agreement"] <= 1


def test_bad_inputs_are_one_line_errors(run, tmp_path, capsys):
    root, _ = run
    data = str(root / "data")
    assert "does not exist" in error_of(capsys, finetune_oracle.main, ["--data", str(tmp_path / "nope"), "--out", str(tmp_path / "o")])
    assert "no preset named 'huge'" in error_of(capsys, finetune_oracle.main, ["--preset", "huge"])
    assert "already holds a model" in error_of(capsys, finetune_oracle.main, ["--data", data, "--out", str(root / "oracle")])
    (tmp_path / "empty").mkdir()
    assert "no trained model" in error_of(capsys, distill_draft.main, ["--data", data, "--teacher", str(tmp_path / "empty"),
                                                                       "--out", str(tmp_path / "d")])
    assert "which this command reads as its teacher" in error_of(capsys, distill_draft.main, [
        "--data", data, "--teacher", str(root / "oracle"), "--out", str(root / "oracle" / "draft")])
    # a teacher or --init model trained with another tokenizer
    other = prepared_run(tmp_path / "other", vocab_size=300)
    finetune_oracle.main(["--data", str(other / "data"), "--out", str(other / "oracle"), "--max-steps", "12"])
    err = error_of(capsys, distill_draft.main, ["--data", data, "--teacher", str(other / "oracle"), "--out", str(tmp_path / "d")])
    assert "vocabulary mismatch" in err
    err = error_of(capsys, finetune_oracle.main, ["--data", str(other / "data"), "--init", str(root / "oracle"), "--out", str(tmp_path / "i")])
    assert "tokenizer mismatch" in err
    err = error_of(capsys, finetune_oracle.main, ["--data", data, "--init", str(tmp_path / "nowhere"), "--out", str(tmp_path / "i")])
    assert f"--init model {tmp_path / 'nowhere'} does not exist, and it is no hub name" in err
    assert not (tmp_path / "d").exists() and not (tmp_path / "i").exists()


@pytest.mark.parametrize("flag, value, message", [
    ("--batch-size", "0", "--batch-size must be at least 1"),
    ("--grad-accum", "0", "--grad-accum must be at least 1"),
    ("--eval-every", "0", "--eval-every must be at least 1"),
    ("--learning-rate", "nan", "must be positive and finite"),
    ("--learning-rate", "-1e-3", "must be positive and finite"),
    ("--dropout", "1", "--dropout in [0, 1)"),
    ("--max-steps", "0", "must be positive and above --warmup-steps"),
    ("--save-every", "-1", "--save-every must be 0"),
    ("--stop-after-steps", "0", "--stop-after-steps must be at least 1"),
    ("--log-with", "wandb", "choose jsonl or tensorboard"),
    ("--kd-temperature", "inf", "--kd-temperature be positive"),
    ("--agreement-batches", "0", "--agreement-batches must be at least 1"),
])
def test_training_numbers_out_of_range_are_refused_before_anything_is_written(run, tmp_path, capsys, flag, value, message):
    argv = ["--data", str(run[0] / "data"), "--out", str(tmp_path / "m"), f"{flag}={value}"]
    main = distill_draft.main if flag in ("--kd-temperature", "--agreement-batches") else finetune_oracle.main
    assert message in error_of(capsys, main, argv + (["--teacher", str(run[0] / "oracle")] if main is distill_draft.main else []))
    assert not (tmp_path / "m").exists() and not (tmp_path / "m-train").exists()


def test_teacher_windows_end_with_the_teachers_greedy_continuation(run, tmp_path):
    from data.shards import open_split
    from train.continuations import POOL_FILE

    root, _ = run
    argv = ["--data", str(root / "data"), "--teacher", str(root / "oracle"), "--max-steps", "20", "--teacher-windows", "0.5"]
    distill_draft.main(argv + ["--out", str(tmp_path / "draft")])
    pool = np.load(tmp_path / "draft-train" / POOL_FILE)["windows"]
    assert pool.shape == (80, 64)  # half of 20 steps x 8 windows, 32 corpus tokens + 32 of the teacher's
    teacher = AutoModelForCausalLM.from_pretrained(root / "oracle").eval()
    text = open_split(root / "data", "train").tobytes()
    for window in pool[:4].astype(np.int64):
        assert window[:32].astype(np.uint16).tobytes() in text
        sequence = torch.from_numpy(window[:32])[None]
        for _ in range(32):  # greedy decoding by hand, one full forward per token
            with torch.no_grad():
                sequence = torch.cat([sequence, teacher(sequence).logits[:, -1:].argmax(-1)], 1)
        assert sequence[0].tolist() == window.tolist()


def test_prompt_prefixes_end_with_a_training_file_prompt_after_an_end_of_text(run):
    from data.shards import open_split
    from decode.tokenizer import load_tokenizer
    from train.continuations import prompt_prefixes

    root, _ = run
    tokenizer = load_tokenizer(root / "tokenizer")
    tokens = np.asarray(open_split(root / "data", "train"))
    prefixes = prompt_prefixes(tokens, tokenizer, 12, 48, np.random.default_rng(0))
    assert prefixes.shape == (12, 48)
    for prefix in prefixes.tolist():
        eos = max(i for i, t in enumerate(prefix) if t == tokenizer.eos_token_id)
        prompt = tokenizer.decode(prefix[eos + 1 :])
        assert prompt.startswith("import math") and prompt.endswith('return the list."""') or prompt.endswith('ignoring case."""')
        filler = np.asarray(prefix[: eos + 1], dtype=tokens.dtype).tobytes()
        assert filler in tokens.tobytes()  # the training text before a document


def test_resumed_distillation_reuses_its_teacher_windows(run, tmp_path):
    root, _ = run
    argv = ["--data", str(root / "data"), "--teacher", str(root / "oracle"), "--max-steps", "16", "--teacher-windows", "0.5",
            "--continuation-temperature", "1.0", "--teacher-prefixes", "prompts", "--continuation-tokens", "16"]
    assert_resumed_distillation_matches(argv, tmp_path)


def test_teacher_windows_raise_agreement_on_the_teachers_output(run, tmp_path):
    """A teacher trained for 10 steps loops when it writes, which its corpus never does: a student that
    saw only the corpus cannot follow it, one that saw the teacher's own continuations can."""
    data, weak = str(run[0] / "data"), str(tmp_path / "weak")
    finetune_oracle.main(["--data", data, "--out", weak, "--max-steps", "10", "--warmup-steps", "2"])
    common = ["--data", data, "--teacher", weak, "--n-embd", "32", "--max-steps", "100"]
    corpus = distill_draft.main(common + ["--out", str(tmp_path / "corpus")])
    mixed = distill_draft.main(common + ["--out", str(tmp_path / "mixed"), "--teacher-windows", "0.5"])
    assert mixed["top1_agreement_on_teacher_output"] > corpus["top1_agreement_on_teacher_output"] + 0.2


def test_bad_teacher_window_settings_are_one_line_errors(run, tmp_path, capsys):
    argv = ["--data", str(run[0] / "data"), "--teacher", str(run[0] / "oracle"), "--out", str(tmp_path / "d")]
    assert "--teacher-windows must lie in [0, 1]" in error_of(capsys, distill_draft.main, argv + ["--teacher-windows", "1.5"])
    assert "--continuation-tokens must lie" in error_of(capsys, distill_draft.main, argv + ["--continuation-tokens", "64"])
    assert "choose corpus or prompts" in error_of(capsys, distill_draft.main, argv + ["--teacher-prefixes", "files"])
    assert "choose one of forward, reverse, tv" in error_of(capsys, distill_draft.main, argv + ["--kd-loss", "js"])
    assert not (tmp_path / "d").exists()


def test_unset_bf16_is_the_calibrated_choice_and_kept_on_resume(run, tmp_path, monkeypatch, capsys):
    import dataclasses

    from train import bf16, loop, presets

    kept = tmp_path / "bf16"
    unmeasured, why = bf16.bf16_choice(width=64, rows=128, cache_dir=kept)  # nothing timed: the CPU's instructions
    assert unmeasured == any(name in machine.cpu_features() for name in ("BF16", "AMX"))
    assert "not calibrated: `python -m train.bf16 --width 64` times both" in why and not list(kept.glob("*"))
    faster, timings = bf16.calibrate(width=64, rows=128, repeats=2, cache_dir=kept)
    assert isinstance(faster, bool) and "ms with bf16 autocast" in timings and "ms in float32" in timings
    assert bf16.bf16_choice(width=64, rows=128, cache_dir=kept) == (faster, timings + ", calibrated on this CPU")
    assert bf16.bf16_choice(width=96, rows=128, cache_dir=kept)[1].endswith("times both")  # per width
    monkeypatch.setitem(presets.ORACLE_PRESETS, "tiny", dataclasses.replace(presets.ORACLE_PRESETS["tiny"], bf16=None))
    monkeypatch.setattr(loop, "bf16_choice", lambda *size: (False, "calibrated"))
    argv = ["--data", str(run[0] / "data"), "--out", str(tmp_path / "oracle"), "--max-steps", "12"]
    finetune_oracle.main(argv + ["--stop-after-steps", "6"])
    assert "bf16 autocast off (calibrated; --bf16 True or False to choose)" in capsys.readouterr().out
    monkeypatch.setattr(loop, "bf16_choice", lambda *size: (True, "calibrated"))  # the resumed run keeps its own
    finetune_oracle.main(argv + ["--resume"])
    assert json.loads((tmp_path / "oracle" / "training_args.json").read_text())["bf16"] is False


def test_training_flags_take_dashes_and_still_accept_underscores(capsys):
    from train.presets import ORACLE_PRESETS, TrainArgs, parse_args

    args = parse_args(TrainArgs, ORACLE_PRESETS, "", ["--max_steps", "70", "--batch-size", "3", "--learning-rate", "1e-3"])
    assert (args.max_steps, args.batch_size, args.learning_rate) == (70, 3, 1e-3)
    with pytest.raises(SystemExit):
        parse_args(TrainArgs, ORACLE_PRESETS, "", ["--help"], prog="python train/finetune_oracle.py")
    shown = capsys.readouterr().out
    assert "usage: python train/finetune_oracle.py" in shown and "--max-steps MAX_STEPS, --max_steps MAX_STEPS" in shown


def test_a_model_named_on_the_hub_that_cannot_be_had_is_a_one_line_error_that_says_how_to_get_it():
    from decode.errors import InputError
    from decode.models.pretrained import load_causal_lm

    with pytest.raises(InputError) as refused:
        load_causal_lm("staged-speculative/no-such-model", "--init model")
    message = str(refused.value)
    assert "\n" not in message and "hf download staged-speculative/no-such-model" in message


@pytest.mark.parametrize("preset, width, shape", [("cpu", 512, None), ("cpu", 576, None), ("cpu", 768, (2, 3, 192)), ("cpu", 896, (2, 4, 256)),
                                                  ("cpu", 1280, (2, 5, 320)), ("quick", 576, (1, 2, 128)),
                                                  ("paper", 896, (4, 6, 384)), ("tiny", 896, None)])
def test_a_presets_draft_is_fitted_to_the_teachers_width(preset, width, shape):
    from train.presets import DRAFT_PRESETS, DistillArgs, fitted_shape, parse_args

    args = parse_args(DistillArgs, DRAFT_PRESETS, "", ["--preset", preset])
    assert fitted_shape(args, width) == shape
    for typed in (["--draft-shape", "preset"], ["--draft-shape", "3x96"], ["--n-embd", "192"]):  # a shape the caller chose
        assert fitted_shape(parse_args(DistillArgs, DRAFT_PRESETS, "", ["--preset", preset, *typed]), width) is None


def test_distillation_says_the_draft_shape_it_fitted_to_its_teacher(tmp_path, capsys):
    from train.presets import DRAFT_PRESETS, DistillArgs, parse_args

    teacher = tmp_path / "teacher"
    teacher.mkdir()
    (teacher / "config.json").write_text(json.dumps({"model_type": "qwen2", "hidden_size": 896}))
    args = parse_args(DistillArgs, DRAFT_PRESETS, "", ["--preset", "cpu", "--teacher", str(teacher)])
    distill_draft.fit_to_teacher(args)
    assert (args.n_layer, args.n_head, args.n_embd) == (2, 4, 256)
    assert "draft shape 2x256 (the cpu preset's 2x128 for a teacher 512 wide, scaled to this one's 896" in capsys.readouterr().out
