"""Which dtype a decoder runs in when asked for "auto": the one the oracle's own forward measures faster in here.

A batch-one forward streams every weight, so bfloat16 halves the bytes; but on a CPU without bfloat16 instructions
torch emulates its products (a tree of 16 nodes cost ten times one token), and the C++ forward widens each bfloat16
weight to float32 as it reads it (docs/decoding.md, "Precision"). Which one wins depends on the CPU, the model's
shape and which forward runs, so on a CPU calibration (decode.calibrate, or decode.plan) times the oracle in both,
over one token and over a tree of 16, and keeps the choice per model, device and C++ forward with the forward costs.
Nothing else times it: without a calibration "auto" is bfloat16 on a CPU with bfloat16 instructions (AVX-512 BF16
or AMX), else float32. A GPU with bfloat16 support decodes in it.
"""
import hashlib
import json
import os
from pathlib import Path

import torch

from decode import native
from decode.devices import device_name, kind, native_bfloat16
from decode.fingerprint import fingerprint
from decode.timing.forwards import by_count, forward_costs
from decode.timing.kept import CACHE_DIR, file_name, kept, read_kept

DTYPES = ("float32", "bfloat16")
PINNED = "STAGED_SPECULATIVE_DTYPE"  # what "auto" resolves to when set (float32 or bfloat16): reproducible runs
TIMED = (1, 16)  # a plain decoding step and a speculative tree's, in new nodes
REPEATS = 20


def auto_dtype(device: str, plan: Path | None = None, oracle: Path | None = None, calibrate: bool = False
               ) -> tuple[str, str]:
    """The dtype "auto" stands for on `device`, and why, in one line: the dtype the `plan` file (RUN/plan.json) was
    planned in on this device (the planner measured these models there); else, on a CPU, the one the `oracle`'s
    forward was calibrated faster in (measured now with `calibrate`, else only read back); else bfloat16 where the
    device has it natively."""
    pinned = os.environ.get(PINNED)
    if pinned in DTYPES:
        return pinned, f"{PINNED}={pinned}"
    planned = plan_dtype(plan, device) if plan is not None else None
    if planned is not None:
        return planned, f"{plan} was planned in it on this device"
    native, why = native_bfloat16(device)
    if not kind(device).measured_dtype:
        return ("bfloat16" if native else "float32"), why
    if oracle is not None and (Path(oracle) / "config.json").is_file():
        calibrated = measured_dtype(Path(oracle), device, calibrate=calibrate)
        if calibrated is not None:
            return calibrated
    unmeasured = "not calibrated: `python -m decode.calibrate` times both" if oracle is not None else "no oracle to time"
    return ("bfloat16" if native else "float32"), f"{why}; {unmeasured}"


def plan_dtype(plan: Path, device: str) -> str | None:
    """The dtype a plan file was measured in, when it was measured on this device; else None."""
    try:
        identity = json.loads(Path(plan).read_text())["identity"]
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError):
        return None
    if identity.get("device") != device_name(torch.device(device)) or identity.get("dtype") not in DTYPES:
        return None
    return identity["dtype"]


def measured_dtype(oracle: Path, device: str, cache_dir: Path | None = None, calibrate: bool = True
                   ) -> tuple[str, str] | None:
    """The dtype whose forwards of the oracle over 1 and 16 new nodes take less time in all, here; with the two
    timings. Measured once per model and device with `calibrate` (a few seconds for the cpu preset's oracle), kept,
    and read back; without `calibrate`, None where it was never measured."""
    name = device_name(torch.device(device))
    code = hashlib.sha256(b"".join(source.read_bytes() for source in native.FORWARD_SOURCES)).hexdigest()[:8]
    path = Path(cache_dir or CACHE_DIR) / f"dtype-{fingerprint(oracle)}-{code}-{file_name(name)}.json"
    measured = (kept(path, lambda: {dtype: time_forwards(oracle, dtype, device) for dtype in DTYPES})[0] if calibrate
                else read_kept(path))
    if measured is None:
        return None
    ms = {dtype: by_count(row) for dtype, row in measured.items()}
    total = {dtype: sum(ms[dtype].values()) for dtype in DTYPES}
    chosen = min(DTYPES, key=total.__getitem__)  # float32 on a tie
    timings = ", ".join(f"{dtype} {' + '.join(f'{ms[dtype][q]:.2f}' for q in TIMED)} ms" for dtype in DTYPES)
    return chosen, f"measured faster here: the oracle's forward of {' and '.join(map(str, TIMED))} nodes took {timings}"


def time_forwards(oracle: Path, dtype: str, device: str) -> dict[int, float]:
    """Milliseconds per forward of the oracle over each of TIMED new nodes, in `dtype` (the decoder's own engine)."""
    from decode.models.loading import load_model  # the engine a decoder would load, lean or transformers'

    model = load_model(oracle, "auto", dtype, device, calibrate=True)  # its layouts and C++ rows calibrated too
    return forward_costs(model, repeats=REPEATS, counts=TIMED)
