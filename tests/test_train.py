import contextlib
import ctypes
import json
import platform

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import write_corpus
from data import prepare
from decode import machine
from decode.models.pretrained import FUSED_GELU
from data.shards import open_split
from decode.models.loading import TOKEN_COUNTS
from train import distill_draft, finetune_oracle, teacher_init
from train.presets import DIVERGENCES


def prepared_run(root, vocab_size=400):
    write_corpus(root / "src")
    prepare.main(["--path", str(root / "src"), "--out", str(root / "run"), "--vocab-size", str(vocab_size),
                  "--val-fraction", "0.3"])
    return root / "run"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A prepared run with a trained tiny oracle."""
    run = prepared_run(tmp_path_factory.mktemp("train"))
    metrics = finetune_oracle.main(["--data", str(run / "data"), "--out", str(run / "oracle")])
    return run, metrics


def error_of(capsys, main, argv) -> str:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1
    return errors[0]


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


def assert_resumed_distillation_matches(argv, tmp_path):
    """A run stopped after 8 steps and resumed ends with the weights of one that ran through."""
    distill_draft.main(argv + ["--out", str(tmp_path / "whole")])
    distill_draft.main(argv + ["--out", str(tmp_path / "parts"), "--stop-after-steps", "8"])
    distill_draft.main(argv + ["--out", str(tmp_path / "parts"), "--resume"])
    assert_same_weights(tmp_path / "whole", tmp_path / "parts")


def assert_same_weights(one, other):
    one, other = load_file(one / "model.safetensors"), load_file(other / "model.safetensors")
    assert one.keys() == other.keys()
    for name in one:
        assert torch.equal(one[name], other[name]), name


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


def test_sparse_targets_reproduce_the_dense_divergence(run):
    """The tiny oracle (a flat one: its top 32 of 400 tokens hold about 80% of the mass) against a perturbed
    copy, on validation windows. With every token kept the sparse divergence is the dense one. With fewer,
    it is never above the dense one (merging outcomes never raises an f-divergence), grows with k, and for
    the forward KL misses exactly the rest's share: p_rest * KL(p_rest_dist || q_rest_dist)."""
    from data.shards import open_split
    from train.loop import PackedWindows
    from train.teacher_targets import sparse_divergence, top_k_targets

    root, _ = run
    teacher = AutoModelForCausalLM.from_pretrained(root / "oracle").eval()
    student = AutoModelForCausalLM.from_pretrained(root / "oracle").eval()
    torch.manual_seed(0)
    with torch.no_grad():
        for weight in student.parameters():
            weight.add_(0.3 * torch.randn_like(weight))
    windows = torch.utils.data.Subset(PackedWindows(open_split(root / "data", "val"), 64), range(8))
    batch = torch.stack([windows[i] for i in range(8)])
    vocab, temperature = teacher.config.vocab_size, 2.0
    with torch.no_grad():
        student_logp = torch.log_softmax(student(batch).logits / temperature, -1)
        teacher_logp = torch.log_softmax(teacher(batch).logits / temperature, -1)
    for kind in DIVERGENCES:
        dense, previous = distill_draft.divergence(student_logp, teacher_logp, kind), 0.0
        for k in (16, 64, vocab):
            top = top_k_targets(teacher, windows, k, temperature, vocab, 3, "cpu", contextlib.nullcontext)
            ids, logp = torch.from_numpy(top["ids"]).long(), torch.from_numpy(top["logp"])
            sparse = sparse_divergence(student_logp.gather(-1, ids), logp, kind)
            assert previous <= sparse <= dense * 1.002, (kind, k, sparse, dense)  # float16 log-probabilities
            previous = sparse
            if kind == "forward" and k < vocab:
                rest = torch.ones_like(teacher_logp, dtype=torch.bool).scatter(-1, ids, False)
                p, q = teacher_logp.exp() * rest, student_logp.exp() * rest
                p_rest, q_rest = p.sum(-1, keepdim=True), q.sum(-1, keepdim=True)
                missed = (p * ((p / p_rest).log() - (q / q_rest).log())).nan_to_num().sum(-1).mean()
                assert torch.allclose(dense - sparse, missed, rtol=1e-2, atol=1e-3), (k, dense - sparse, missed)
        assert torch.allclose(sparse, dense, rtol=2e-3), (kind, sparse, dense)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="a setting of glibc's malloc")
def test_kept_freed_memory_serves_large_tensors_from_the_heap():
    """After keep_freed_memory, a 64 MB tensor is not mapped on its own (glibc's mmapped bytes do not grow) and
    its memory stays with the process when freed, for the next one."""
    from train.loop import keep_freed_memory

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in
                    ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = MallInfo2
    keep_freed_memory()
    before = libc.mallinfo2()
    tensor = torch.ones(16 << 20)
    during = libc.mallinfo2()
    del tensor
    after = libc.mallinfo2()
    assert during.hblkhd == before.hblkhd and during.uordblks >= before.uordblks + (64 << 20)
    assert after.arena >= 64 << 20 and after.fordblks >= 64 << 20  # freed, kept


def test_selected_log_probs_gradient_is_the_numerical_one():
    """The log-softmax at chosen columns, a column chosen twice in some rows: its hand-written backward
    against finite differences, in float64."""
    from train.teacher_targets import selected_log_probs

    torch.manual_seed(0)
    logits = torch.randn(3, 4, 9, dtype=torch.float64, requires_grad=True)
    columns = torch.randint(0, 9, (3, 4, 5))
    columns[0, :, 1] = columns[0, :, 0]
    assert torch.allclose(selected_log_probs(logits, columns), torch.log_softmax(logits, -1).gather(-1, columns))
    assert torch.autograd.gradcheck(selected_log_probs, (logits, columns))


def test_selected_log_probs_gradient_does_not_depend_on_the_order_columns_are_added_in():
    """On CUDA scatter_add_ adds with atomics in no fixed order, so a column chosen twice (the next token among
    the teacher's) must not reach it as two values: with the columns and their gradients reversed, the logits'
    gradient is the same bit for bit."""
    from train.teacher_targets import selected_log_probs

    torch.manual_seed(0)
    logits = torch.randn(64, 8, 50, requires_grad=True)
    columns = torch.randint(0, 50, (64, 8, 6))
    columns[..., -1] = columns[..., 2]
    # whole numbers of several magnitudes: their sums are exact in any order, while a logit's gradient plus one
    # of them, then the other, rounds differently in each order
    weights = torch.randint(-2**12, 2**12, (64, 8, 6)).float()
    grads = []
    for reverse in (False, True):
        order = (lambda t: t.flip(-1)) if reverse else (lambda t: t)
        (selected_log_probs(logits, order(columns)) * order(weights)).sum().backward()
        grads.append(logits.grad)
        logits.grad = None
    assert torch.equal(*grads)


@pytest.mark.parametrize("temperature", [1.0, 2.0])
@pytest.mark.parametrize("kind", DIVERGENCES)
def test_sparse_loss_is_autograd_through_the_dense_log_softmax(kind, temperature):
    """The sparse loss reads the student's log-probabilities at the teacher's tokens and the next token only;
    its value and its gradient are those of autograd through the dense log-softmax (the divergence on it, and
    next_token_loss), where the next token is one of the teacher's tokens as well as where it is not."""
    from train.loop import next_token_loss
    from train.teacher_targets import sparse_divergence

    torch.manual_seed(0)
    logits = (3 * torch.randn(2, 7, 40)).requires_grad_()
    top = torch.log_softmax(2 * torch.randn(2, 7, 40), -1).topk(6)
    ids, teacher_logp = top.indices.int(), top.values.half()
    windows = torch.randint(0, 40, (2, 7))
    windows[0, 1:] = top.indices[0, :-1, 0]  # the teacher's likeliest token comes next
    losses = []
    for dense in (True, False):
        if dense:
            log_q = torch.log_softmax(logits / temperature, -1).gather(-1, ids.long())
            kd, ce = sparse_divergence(log_q, teacher_logp, kind) * temperature**2, next_token_loss(logits, windows)
            loss = 0.7 * kd + 0.3 * ce
        else:
            loss, kd, ce = distill_draft.loss_terms(logits, windows, (ids, teacher_logp), 0.7, temperature, kind)
        losses.append((loss.detach(), kd.detach(), ce.detach(), torch.autograd.grad(loss, logits)[0]))
    (*dense_values, dense_grad), (*values, grad) = losses
    assert dense_values[1] > 1e-3 and dense_values[2] > 1.0  # terms worth comparing
    for value, expected in zip(values, dense_values):
        assert torch.allclose(value, expected, rtol=1e-5), (value, expected)
    assert torch.allclose(grad, dense_grad, rtol=1e-4, atol=1e-7), (grad - dense_grad).abs().max()


@pytest.mark.parametrize("kind, sparse", [("tv", False), ("forward", True)])
def test_compiled_loss_is_the_eager_loss(run, monkeypatch, kind, sparse):
    """--compile-loss changes how a step's loss is computed, not what: through torch.compile (the teacher's
    forward and the loss terms) the loss and the student's gradient are the eager ones, to float32 rounding."""
    from train.teacher_targets import top_k_targets

    root, _ = run
    teacher = AutoModelForCausalLM.from_pretrained(root / "oracle").eval().requires_grad_(False)
    torch.manual_seed(0)
    windows = torch.randint(0, teacher.config.vocab_size, (4, 32))
    batch = windows
    if sparse:
        top = top_k_targets(teacher, windows, 24, 2.0, teacher.config.vocab_size, 4, "cpu", contextlib.nullcontext)
        batch = (windows, torch.from_numpy(top["ids"]), torch.from_numpy(top["logp"]))
    compile_, compiled_calls = torch.compile, []
    monkeypatch.setattr(torch, "compile", lambda fn: compiled_calls.append(fn) or compile_(fn))
    results = []
    for compiled in (False, True):
        student = AutoModelForCausalLM.from_pretrained(root / "oracle")
        with torch.no_grad():
            for weight in student.parameters():
                weight.add_(0.3 * torch.randn(weight.shape, generator=torch.Generator().manual_seed(weight.numel())))
        loss_fn = distill_draft.distillation_loss(teacher, 0.7, 2.0, kind, contextlib.nullcontext, compiled)
        loss, logs = loss_fn(student, batch)
        loss.backward()
        results.append((loss.detach(), logs, torch.cat([w.grad.flatten() for w in student.parameters()])))
    (eager, eager_logs, eager_grad), (compiled, compiled_logs, compiled_grad) = results
    assert len(compiled_calls) == 2 and teacher in compiled_calls  # the teacher's forward and the loss terms
    assert eager > 0.1 and eager_grad.abs().max() > 1e-3  # a loss worth comparing
    assert torch.allclose(compiled, eager, rtol=1e-5), (compiled, eager)
    assert compiled_logs == pytest.approx(eager_logs, rel=1e-5)
    assert torch.allclose(compiled_grad, eager_grad, rtol=1e-4, atol=1e-6)


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA, training runs on the GPU, whose compiled kernels are Triton's")
def test_compiling_without_a_cpp_compiler_is_a_one_line_error(run, tmp_path, monkeypatch, capsys):
    """torch.compile on a CPU builds C++ at the first step: without a compiler, one line naming the flags,
    before anything is written."""
    from torch._inductor import config

    root, _ = run
    monkeypatch.setattr(config.cpp, "cxx", (None, str(tmp_path / "no-such-g++")))
    argv = ["--data", str(root / "data"), "--teacher", str(root / "oracle"), "--out", str(tmp_path / "d")]
    assert "--compile-loss needs a C++ compiler" in error_of(capsys, distill_draft.main, argv + ["--compile-loss", "True"])
    message = error_of(capsys, finetune_oracle.main, argv[:2] + ["--out", str(tmp_path / "o"), "--compile", "True"])
    assert "--compile needs a C++ compiler" in message and "pass --compile False" in message
    assert not list(tmp_path.glob("[do]*"))


def test_distillation_on_sparse_targets_trains_and_resumes(run, tmp_path, capsys):
    from data.shards import open_split
    from train.loop import PackedWindows
    from train.teacher_targets import TARGETS_FILE

    root, _ = run
    common = ["--data", str(root / "data"), "--teacher", str(root / "oracle"), "--n-embd", "32"]
    sparse = common + ["--sparse-targets", "32", "--target-epochs", "4", "--max-steps", "150", "--kd-weight", "1.0"]
    distilled = distill_draft.main(sparse + ["--out", str(tmp_path / "sparse")])
    distinct = min(150 * 8 // 4, len(PackedWindows(open_split(root / "data", "train"), 64)))  # a tiny corpus has fewer
    with np.load(tmp_path / "sparse-train" / TARGETS_FILE) as targets:
        assert targets["ids"].shape == targets["logp"].shape == (distinct, 64, 32)
    plain = distill_draft.main(common + ["--max-steps", "150", "--kd-weight", "0.0", "--out", str(tmp_path / "plain")])
    assert distilled["top1_agreement"] > plain["top1_agreement"] + 0.02

    short = common + ["--target-epochs", "4", "--max-steps", "16", "--teacher-windows", "0.5"]
    assert_resumed_distillation_matches(short + ["--sparse-targets", "32"], tmp_path)
    resumed_otherwise = short + ["--sparse-targets", "8", "--out", str(tmp_path / "parts"), "--resume"]
    assert "different sparse_targets" in error_of(capsys, distill_draft.main, resumed_otherwise)

    argv = common + ["--out", str(tmp_path / "bad")]
    assert "--sparse-targets must be 0" in error_of(capsys, distill_draft.main, argv + ["--sparse-targets", "-1"])
    assert "--target-epochs at least 1" in error_of(capsys, distill_draft.main, argv + ["--target-epochs", "0"])
    assert "exceeds the vocabulary (400 tokens)" in error_of(capsys, distill_draft.main, argv + ["--sparse-targets", "500"])
    assert not (tmp_path / "bad").exists()


def test_a_run_stopped_before_its_first_checkpoint_resumes_on_its_targets_and_overwrite_rebuilds_them(
        run, tmp_path, monkeypatch, capsys):
    """Generating targets takes minutes on the cpu preset: a run stopped after that, before its first checkpoint,
    resumes on them (ending with the weights of a run that went through). --overwrite starts from nothing, so a
    replaced run's targets, stale if the teacher changed, are never reused."""
    from train import teacher_targets
    from train.teacher_targets import TARGETS_FILE

    root, _ = run
    argv = ["--data", str(root / "data"), "--teacher", str(root / "oracle"), "--n-embd", "32", "--max-steps", "12",
            "--sparse-targets", "16", "--target-epochs", "2"]
    distill_draft.main(argv + ["--out", str(tmp_path / "whole")])
    parts, work = argv + ["--out", str(tmp_path / "parts")], tmp_path / "parts-train"

    def stop(*_):
        raise KeyboardInterrupt

    with monkeypatch.context() as patched:
        patched.setattr(distill_draft, "sparse_terms", stop)  # the first step
        with pytest.raises(SystemExit):  # Ctrl-C: exit 130, saying what it had written
            distill_draft.main(parts)
    assert (work / TARGETS_FILE).is_file() and not (work / "checkpoints").exists()
    assert "pass --resume to start it again" in error_of(capsys, distill_draft.main, parts)
    started_otherwise = parts + ["--resume", "--teacher-embeddings", "True", "--teacher-layers", "True"]
    assert "different teacher_embeddings, teacher_layers" in error_of(capsys, distill_draft.main, started_otherwise)

    built = []
    build = teacher_targets.top_k_targets
    monkeypatch.setattr(distill_draft, "top_k_targets", lambda *a: built.append(1) or build(*a))
    distill_draft.main(parts + ["--resume"])
    assert not built
    assert_same_weights(tmp_path / "whole", tmp_path / "parts")

    with np.load(work / TARGETS_FILE) as saved:
        stale = {name: saved[name] for name in saved.files}
    np.savez(work / TARGETS_FILE, ids=stale["ids"], logp=np.zeros_like(stale["logp"]))  # another teacher's, same shape
    distill_draft.main(parts + ["--overwrite"])
    assert built
    with np.load(work / TARGETS_FILE) as rebuilt:
        assert np.array_equal(rebuilt["logp"], stale["logp"])
    assert_same_weights(tmp_path / "whole", tmp_path / "parts")


def test_targets_from_another_run_are_copied_not_computed_and_refused_when_its_settings_differ(
        run, tmp_path, monkeypatch, capsys):
    """Student shapes compared against one teacher pay for its windows and targets once: a run given another's
    work directory trains on copies of them and ends where computing them itself would have ended."""
    from train.continuations import POOL_FILE
    from train.teacher_targets import TARGETS_FILE

    root, _ = run
    argv = ["--data", str(root / "data"), "--teacher", str(root / "oracle"), "--n-embd", "32", "--max-steps", "12",
            "--sparse-targets", "16", "--target-epochs", "2", "--teacher-windows", "0.5", "--continuation-tokens", "16"]
    distill_draft.main(argv + ["--out", str(tmp_path / "first")])
    deeper = argv + ["--n-layer", "3"]
    distill_draft.main(deeper + ["--out", str(tmp_path / "own")])

    built = []
    monkeypatch.setattr(distill_draft, "top_k_targets", lambda *a: built.append("targets"))
    monkeypatch.setattr(distill_draft, "build_pool", lambda *a: built.append("windows"))
    reuse = ["--targets-from", str(tmp_path / "first-train")]
    distill_draft.main(deeper + reuse + ["--out", str(tmp_path / "copied")])
    assert not built
    for name in (POOL_FILE, TARGETS_FILE):
        assert (tmp_path / "copied-train" / name).read_bytes() == (tmp_path / "first-train" / name).read_bytes()
    assert_same_weights(tmp_path / "own", tmp_path / "copied")

    bad = ["--out", str(tmp_path / "bad")]
    message = error_of(capsys, distill_draft.main, deeper + reuse + bad + ["--seed", "1", "--max-steps", "13"])
    assert "different --seed, --max-steps" in message and "drop --targets-from" in message
    message = error_of(capsys, distill_draft.main, deeper + ["--targets-from", str(tmp_path / "own")] + bad)
    assert "no teacher_targets.npz there" in message
    message = error_of(capsys, distill_draft.main, deeper + reuse + bad + ["--sparse-targets", "0"])
    assert "--targets-from needs --sparse-targets" in message
    assert not list(tmp_path.glob("bad*"))


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


def test_teacher_layers_at_the_teachers_shape_copy_the_teacher_exactly(run, tmp_path, capsys):
    """With the identity as the basis and the teacher's shape, the student built from the teacher's embeddings and
    blocks is the teacher (layer norms folded, heads, q/k/v and MLP units in place); narrower, it is a start
    whose logits are closer to the teacher's than the embeddings alone give. --teacher-layers needs the embeddings."""
    from transformers import GPT2Config, GPT2LMHeadModel

    root, _ = run
    teacher = AutoModelForCausalLM.from_pretrained(root / "oracle").eval()
    with torch.no_grad():  # layer norms away from gain 1, bias 0, so that folding them is checked
        for name, parameter in teacher.named_parameters():
            if ".ln_" in name:
                parameter.add_(0.1 * torch.randn_like(parameter))
    config, width = teacher.config, teacher.config.n_embd
    windows = torch.from_numpy(np.fromfile(root / "data" / "val.bin", np.uint16)[:192].astype(np.int64)).view(3, 64)
    same = GPT2LMHeadModel(GPT2Config(**{**config.to_dict(), "architectures": None})).eval()
    teacher_init.copy_teacher_embeddings(teacher, same, torch.eye(width))
    teacher_init.copy_teacher_layers(teacher, same, torch.eye(width))
    with torch.no_grad():
        assert torch.allclose(same(windows).logits, teacher(windows).logits, atol=1e-4)

    def divergence_from_teacher(layers: bool) -> float:
        torch.manual_seed(0)
        student = GPT2LMHeadModel(GPT2Config(vocab_size=config.vocab_size, n_positions=64, n_embd=width // 2,
                                             n_layer=1, n_head=config.n_head // 2)).eval()
        teacher_init.copy_teacher_embeddings(teacher, student)
        if layers:
            teacher_init.copy_teacher_layers(teacher, student)
        with torch.no_grad():
            return torch.nn.functional.kl_div(student(windows).logits.log_softmax(-1), teacher(windows).logits.log_softmax(-1),
                                              log_target=True, reduction="batchmean").item()

    assert divergence_from_teacher(layers=True) < divergence_from_teacher(layers=False)
    argv = ["--data", str(root / "data"), "--teacher", str(root / "oracle"), "--out", str(tmp_path / "d"), "--teacher-layers", "True"]
    assert "needs --teacher-embeddings True" in error_of(capsys, distill_draft.main, argv)
    wide = argv + ["--teacher-embeddings", "True", "--n-layer", str(config.n_layer + 1)]
    assert "must be no larger than the teacher" in error_of(capsys, distill_draft.main, wide)
    assert not (tmp_path / "d").exists() and not (tmp_path / "d-train").exists()


def test_teacher_embeddings_start_the_student_as_the_teachers_best_low_rank_copy(run, tmp_path, capsys):
    """At the teacher's width the student's token embeddings are the teacher's in a rotated basis (same dot
    products, so the tied output layer gives the teacher's logits for the rotated hidden state); narrower,
    their dot products are the best rank-n_embd approximation of the teacher's (Eckart-Young: the error is
    the dropped singular values'). Distillation from that start agrees with the teacher more in as many steps."""
    from transformers import GPT2Config, GPT2LMHeadModel

    root, _ = run
    teacher = AutoModelForCausalLM.from_pretrained(root / "oracle")
    t_wte, t_wpe = teacher.transformer.wte.weight.detach(), teacher.transformer.wpe.weight.detach()
    singular = torch.linalg.svdvals(t_wte)
    for width in (t_wte.shape[1], 16):
        student = GPT2LMHeadModel(GPT2Config(vocab_size=len(t_wte), n_positions=64, n_embd=width, n_layer=1, n_head=2))
        teacher_init.copy_teacher_embeddings(teacher, student)
        s_wte, s_wpe = student.transformer.wte.weight.detach(), student.transformer.wpe.weight.detach()
        error = torch.linalg.matrix_norm(t_wte @ t_wte.T - s_wte @ s_wte.T)
        assert error == pytest.approx(singular[width:].pow(4).sum().sqrt().item(), rel=1e-3, abs=1e-3)
        if width == t_wte.shape[1]:
            assert torch.allclose(s_wpe @ s_wpe.T, t_wpe @ t_wpe.T, atol=1e-4)
            assert torch.allclose(s_wte @ s_wpe.T, t_wte @ t_wpe.T, atol=1e-4)
    common = ["--data", str(root / "data"), "--teacher", str(root / "oracle"), "--n-embd", "32", "--max-steps", "40"]
    plain = distill_draft.main(common + ["--out", str(tmp_path / "plain")])
    copied = distill_draft.main(common + ["--out", str(tmp_path / "copied"), "--teacher-embeddings", "True"])
    assert copied["top1_agreement"] > plain["top1_agreement"] + 0.2  # measured: 0.36 -> 0.83 (seeds 0 and 1 alike)
    wide = common + ["--out", str(tmp_path / "wide"), "--n-embd", "128", "--teacher-embeddings", "True"]
    assert "exceeds the teacher's 64" in error_of(capsys, distill_draft.main, wide)
    assert not (tmp_path / "wide").exists() and not (tmp_path / "wide-train").exists()


def test_training_flags_take_dashes_and_still_accept_underscores(capsys):
    from train.presets import ORACLE_PRESETS, TrainArgs, parse_args

    args = parse_args(TrainArgs, ORACLE_PRESETS, "", ["--max_steps", "70", "--batch-size", "3", "--learning-rate", "1e-3"])
    assert (args.max_steps, args.batch_size, args.learning_rate) == (70, 3, 1e-3)
    with pytest.raises(SystemExit):
        parse_args(TrainArgs, ORACLE_PRESETS, "", ["--help"], prog="python train/finetune_oracle.py")
    shown = capsys.readouterr().out
    assert "usage: python train/finetune_oracle.py" in shown and "--max-steps MAX_STEPS, --max_steps MAX_STEPS" in shown
