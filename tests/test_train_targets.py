"""Distillation's targets: sparse top-k targets against the dense divergence, the losses' gradients, the compiled loss,
and teacher windows kept, resumed, copied from another run or refused."""
import contextlib
import ctypes
import platform
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import child_env
from train_runs import assert_resumed_distillation_matches, assert_same_weights, error_of
from transformers import AutoModelForCausalLM

from data.shards import open_split
from decode import machine as decode_machine
from train import distill_draft, finetune_oracle
from train.presets import DIVERGENCES


@pytest.fixture(scope="module")
def run(trained_oracle_run):
    return trained_oracle_run


def test_sparse_targets_reproduce_the_dense_divergence(run):
    """The tiny oracle (a flat one: its top 32 of 400 tokens hold about 80% of the mass) against a perturbed
    copy, on validation windows. With every token kept the sparse divergence is the dense one. With fewer,
    it is never above the dense one (merging outcomes never raises an f-divergence), grows with k, and for
    the forward KL misses exactly the rest's share: p_rest * KL(p_rest_dist || q_rest_dist)."""
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


# The loss terms of a quick-preset-sized step, eager and through torch.compile
COMPILED_LOSS = """
import decode  # (first: with STAGED_SPECULATIVE_CPU=avx2 it sets torch's kernel settings before torch loads)
import torch
from train.distill_draft import loss_terms
torch.manual_seed(0)
logits, targets, windows = torch.randn(4, 32, 8192) * 3, torch.randn(4, 32, 8192) * 3, torch.randint(0, 8192, (4, 32))
eager = loss_terms(logits, windows, targets, 0.8, 2.0, "tv")
compiled = torch.compile(lambda *a: loss_terms(*a, 0.8, 2.0, "tv"))(logits, windows, targets)
print(torch.backends.cpu.get_cpu_capability(), all(torch.allclose(c, e, rtol=1e-5) for c, e in zip(compiled, eager)))
"""


def test_a_cpu_taken_for_avx2_alone_never_takes_torch_compiles_kernels_for_its_own_vectors(tmp_path):
    """torch.compile's cache keys leave out the vector width ATEN_CPU_CAPABILITY picks: a process taking the CPU for
    one with AVX2 alone after one that used its own instructions, both on one cache, would run the first one's
    kernels and get wrong losses."""
    if "avx2" not in open("/proc/cpuinfo").read():
        pytest.skip("this CPU lacks AVX2")
    env = child_env(TORCHINDUCTOR_CACHE_DIR=str(tmp_path))
    for name in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", decode_machine.AS_CPU):
        env.pop(name, None)
    said = []
    for taken_as in ({}, {decode_machine.AS_CPU: "avx2"}):
        done = subprocess.run([sys.executable, "-c", COMPILED_LOSS], env=env | taken_as, capture_output=True,
                              text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        said.append(done.stdout.split()[-2:])
    assert said[0][1] == "True" and said[1] == ["AVX2", "True"], said


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


def test_teacher_continuations_keep_token_ids_past_65535():
    import contextlib
    from types import SimpleNamespace

    from train.continuations import build_pool

    class Teacher:  # a 130,000-token teacher that continues every prefix with ids a uint16 cannot hold
        config = SimpleNamespace(vocab_size=130_000)

        def generate(self, prefixes, max_new_tokens, **settings):
            tail = torch.tensor([70_000, 5, 128_000, 129_999][:max_new_tokens]).expand(len(prefixes), -1)
            return torch.cat([prefixes, tail], dim=1)

    prefixes = torch.tensor([[1, 65_536], [2, 100_000]])
    pool = build_pool(Teacher(), prefixes, 4, 0.0, 0, seed=0, batch_size=1, device="cpu", autocast=contextlib.nullcontext)
    assert pool.tolist() == [[1, 65_536, 70_000, 5, 128_000, 129_999], [2, 100_000, 70_000, 5, 128_000, 129_999]]
