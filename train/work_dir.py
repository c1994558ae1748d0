"""A training run's directories: the model it writes (OUT) and its work directory (checkpoints, args.json, what it
generated before training), checked before a run starts so that runs never mix and nothing not a run's is replaced."""
import json
import shutil
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import numpy as np

from decode.atomic import MODEL, Kind, atomic_output
from decode.atomic import check_output as check_output_path
from decode.errors import InputError, first_line
from train.presets import TrainArgs

CHECKPOINT_PREFIX = "step-"
WORK_DIR = Kind("training work directory", "args.json")
CHECKPOINT_FILES = ("optimizer.bin", "custom_checkpoint_0.pkl")  # the optimizer's and the scheduler's state


def work_dir_of(args: TrainArgs) -> Path:
    return Path(args.work_dir) if args.work_dir else Path(f"{args.out}-train")


def checkpoints(work_dir: Path) -> list[Path]:
    return sorted(p for p in (work_dir / "checkpoints").glob(f"{CHECKPOINT_PREFIX}*") if p.is_dir())


def check_output(args: TrainArgs) -> Path:
    """Refuse to mix runs or to replace what is not ours: OUT may hold a model and the work directory a
    run only with --resume (continue it) or --overwrite (replace it); anything else there is refused."""
    work_dir, out = work_dir_of(args), Path(args.out)
    if args.resume and args.overwrite:
        raise InputError("--resume and --overwrite contradict each other; pass one")
    reads = {"data": args.data, "starting model": args.init if args.init and Path(args.init).exists() else None,
             "teacher": getattr(args, "teacher", None)}
    check_output_path(out, MODEL, args.overwrite or args.resume, "--out", reads)
    check_output_path(work_dir, WORK_DIR, True, "--work-dir", reads)  # a run there: decided below
    if args.resume:
        if not (work_dir / WORK_DIR.marker).is_file():
            raise InputError(f"nothing to resume: no run in {work_dir}; run without --resume")
        # the teacher_ starts matter where a run stopped before its first checkpoint: it starts again from them
        kept = ("n_layer", "n_head", "n_embd", "seq_len", "init", "data", "max_steps", "seed", "kd_loss", "teacher_windows",
                "teacher_prefixes", "continuation_tokens", "continuation_temperature", "kd_temperature", "sparse_targets",
                "target_epochs", "teacher_embeddings", "teacher_layers", "teacher")
        changed = changed_args(read_saved_args(work_dir), args, kept)
        if changed:
            raise InputError(f"--resume with different {', '.join(changed)} than the checkpointed run; keep them, or start over with --overwrite")
    elif not args.overwrite and (out / MODEL.marker).exists():
        raise InputError(f"{out} already holds a model; pass --overwrite to replace it, or another --out")
    elif not args.overwrite and checkpoints(work_dir):
        raise InputError(f"{work_dir} already holds a run; pass --resume to continue it or --overwrite to replace it")
    elif not args.overwrite and (work_dir / WORK_DIR.marker).exists():
        raise InputError(f"{work_dir} holds a run that stopped before its first checkpoint; pass --resume to start it again "
                         f"on what it already generated (teacher windows, targets), or --overwrite to start over")
    return work_dir


def start_work_dir(work_dir: Path, args: TrainArgs) -> None:
    """A new run's work directory, before anything is generated into it: --overwrite empties it first (check_output
    made sure it holds a run), so nothing from the run it replaces is reused; args.json marks it as a run's."""
    if args.overwrite:
        shutil.rmtree(work_dir, ignore_errors=True)
    work_dir.mkdir(parents=True, exist_ok=True)
    (work_dir / WORK_DIR.marker).write_text(json.dumps(asdict(args), indent=2) + "\n")


def load_or_build_arrays(path: Path, build: Callable[[], dict], shapes: dict, dtypes: dict | None = None) -> dict:
    """Arrays generated once before training and kept in the work directory (so a resumed run trains on the
    same ones): those at `path` (an .npz) if they have the expected shapes (and `dtypes`, where given), else
    `build()`'s, written atomically."""
    try:
        with np.load(path) as saved:
            arrays = {name: saved[name] for name in shapes}
        if all(arrays[name].shape == shape for name, shape in shapes.items()) and all(
                arrays[name].dtype == dtype for name, dtype in (dtypes or {}).items()):
            return arrays
    except (OSError, ValueError, KeyError, EOFError):
        pass  # none yet, or damaged: generate them again
    arrays = build()
    with atomic_output(path, overwrite=True) as tmp, open(tmp, "wb") as file:
        np.savez(file, **arrays)
    return arrays


def changed_args(saved: dict, args: TrainArgs, names) -> list[str]:
    """Those of `names` that a run's saved args.json sets to another value than `args` (paths compared resolved)."""
    def same(name):
        if name in ("data", "teacher"):
            return Path(saved[name]).resolve() == Path(getattr(args, name)).resolve()
        return saved[name] == getattr(args, name, None)
    return [name for name in names if name in saved and not same(name)]


def read_saved_args(work_dir: Path, refused: str = "cannot resume", fix: str = "start over with --overwrite") -> dict:
    path = work_dir / WORK_DIR.marker
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise InputError(f"{refused}: {path} is missing or damaged ({first_line(err)}); {fix}") from None


def check_checkpoint(checkpoint: Path, process_index: int) -> None:
    """Refuse to resume from a checkpoint that would not restore the run exactly."""
    needed = (*CHECKPOINT_FILES, f"random_states_{process_index}.pkl")
    missing = [name for name in needed if not (checkpoint / name).is_file() or (checkpoint / name).stat().st_size == 0]
    if not any(checkpoint.glob("model*")) and not any(checkpoint.glob("pytorch_model*")):
        missing.append("the model's weights")
    if missing:
        raise InputError(f"checkpoint {checkpoint} is incomplete (missing or empty: {', '.join(missing)}); delete it to "
                         f"resume from the one before, or start over with --overwrite")
