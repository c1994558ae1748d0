"""Training on two processes, launched as users launch it (`accelerate launch`), on the CPU over gloo: the same
model as one process with the whole batch, a run killed mid-way resumes on two processes, and only the first
process writes the run's files."""
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import child_env
from safetensors.torch import load_file
from train_runs import prepared_run

pytestmark = pytest.mark.processes

ROOT = Path(__file__).resolve().parent.parent
LAUNCH = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--num_machines",
          "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
FAST = ["--warmup-steps", "2", "--eval-every", "4", "--seq-len", "32"]


def launch(script: str, args: list[str], processes: int = 2, **popen) -> subprocess.Popen:
    env = child_env(OMP_NUM_THREADS="1")
    env.pop("CUDA_VISIBLE_DEVICES", None)
    command = LAUNCH + ["--main_process_port", str(free_port()), script, *args] if processes == 2 else [sys.executable, script, *args]
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, **popen)


def kill_tree(pid: int) -> None:
    """SIGKILL a process and every process under it: accelerate's launcher starts each worker with setsid, out of its
    own process group, so killing that group leaves the workers training on, into the same checkpoints."""
    children = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):  # gone meanwhile
            continue
        children.setdefault(parent, []).append(int(stat.parent.name))
    tree = [pid]
    for process in tree:
        tree += children.get(process, [])
    for process in reversed(tree):
        try:
            os.kill(process, signal.SIGKILL)
        except ProcessLookupError:
            pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def finished(process: subprocess.Popen, timeout: int = 240) -> str:
    out, _ = process.communicate(timeout=timeout)
    assert process.returncode == 0, out[-3000:]
    return out


def weights(directory: Path) -> dict:
    return load_file(str(directory / "model.safetensors"))


def assert_same_model(a: Path, b: Path, tolerance: float = 1e-4) -> None:
    x, y = weights(a), weights(b)
    assert x.keys() == y.keys()
    worst = max(float((x[k] - y[k]).abs().max()) for k in x)
    assert worst < tolerance, f"{a.name} and {b.name} differ by {worst}"


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return prepared_run(tmp_path_factory.mktemp("processes")) / "data"


@pytest.fixture(scope="module")
def oracles(data):
    """The tiny oracle trained by one process with a batch of 4 and by two with 2 each."""
    root = data.parent
    common = ["--data", str(data), "--max-steps", "12", *FAST]
    one = launch("train/finetune_oracle.py", common + ["--out", str(root / "one"), "--batch-size", "4"], processes=1)
    finished(one)
    two = finished(launch("train/finetune_oracle.py", common + ["--out", str(root / "two"), "--batch-size", "2"]))
    return root, two


def test_two_processes_with_half_the_batch_train_the_oracle_one_process_trains(oracles):
    root, printed = oracles
    assert_same_model(root / "one", root / "two")
    one, two = (json.loads((root / name / "metrics.json").read_text()) for name in ("one", "two"))
    assert abs(one["val_loss"] - two["val_loss"]) < 1e-4  # validated on the same windows
    assert printed.count("saved to") == 1 and printed.count("bf16 autocast") <= 1  # one process reports


def test_only_the_first_process_writes_the_run(oracles):
    root, _ = oracles
    one, two = root / "one", root / "two"
    assert sorted(p.name for p in one.iterdir()) == sorted(p.name for p in two.iterdir())
    assert sorted(p.name for p in (root / "one-train").iterdir()) == sorted(p.name for p in (root / "two-train").iterdir())
    lines = [json.loads(line) for line in (root / "two-train" / "log.jsonl").read_text().splitlines()]
    logged = [line["step"] for line in lines if "step" in line]
    assert logged == list(range(13)) and len(lines) == 14  # its settings, then each step once: one process logs
    checkpoint = sorted((root / "two-train" / "checkpoints").iterdir())[-1]
    # accelerate keeps each process's random state (exact resume); the model and optimizer once
    assert {p.name for p in checkpoint.iterdir()} >= {"model.safetensors", "optimizer.bin", "random_states_0.pkl",
                                                      "random_states_1.pkl"}


def test_two_processes_distil_the_draft_one_process_distils(oracles):
    root, _ = oracles
    common = ["--teacher", str(root / "one"), "--data", str(root / "data"), "--max-steps", "8", *FAST,
              "--continuation-tokens", "16"]
    finished(launch("train/distill_draft.py", common + ["--out", str(root / "draft-one"), "--batch-size", "4"],
                    processes=1))
    finished(launch("train/distill_draft.py", common + ["--out", str(root / "draft-two"), "--batch-size", "2"]))
    assert_same_model(root / "draft-one", root / "draft-two")
    one, two = (json.loads((root / name / "metrics.json").read_text()) for name in ("draft-one", "draft-two"))
    assert abs(one["top1_agreement"] - two["top1_agreement"]) < 1e-3


def test_a_two_process_run_killed_mid_way_resumes_on_two_processes(oracles):
    root, _ = oracles
    common = ["--data", str(root / "data"), "--max-steps", "400", "--save-every", "10", "--batch-size", "2", *FAST]
    whole = launch("train/finetune_oracle.py", common + ["--out", str(root / "whole")])
    killed = launch("train/finetune_oracle.py", common + ["--out", str(root / "killed")])
    checkpoints = root / "killed-train" / "checkpoints"
    deadline = time.time() + 180
    while not any(p.name.startswith("step-") for p in checkpoints.glob("step-*")) and time.time() < deadline:
        time.sleep(0.05)
    kill_tree(killed.pid)  # the launcher and both processes, mid-way
    killed.wait()
    assert not (root / "killed" / "model.safetensors").exists(), "the run finished before it was killed"
    finished(launch("train/finetune_oracle.py", common + ["--out", str(root / "killed"), "--resume"]))
    finished(whole)
    assert_same_model(root / "whole", root / "killed", tolerance=1e-5)
