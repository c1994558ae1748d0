"""Whether training runs in bf16 autocast on this device. A GPU says whether it supports bf16. On a CPU the choice is
a calibration kept per CPU, threads, torch version and model width, made by an explicit step:

    python -m train.bf16 --width 512    # one MLP block's training step timed with and without autocast

and read back by every training run; without one, autocast is on only where the CPU multiplies in bf16 natively
(AVX-512 BF16 or AMX). A CPU with AVX2 alone emulates bf16: its autocast training ran over 100x slower there
(docs/training.md). Training never times itself."""
import argparse
import time
from pathlib import Path

import numpy as np
import torch

from decode.cli.help import HelpFormatter
from decode.devices import native_bfloat16
from decode.fingerprint import CACHE_ROOT
from decode.machine import cpu_features, cpu_name
from decode.timing.kept import file_name, keep, read_kept

BF16_CACHE = CACHE_ROOT / "bf16"
PROG = "python -m train.bf16"


def kept_path(width: int, rows: int, cache_dir: Path | None = None) -> Path:
    """Where the calibration for this CPU, threads, torch and shape is kept."""
    key = f"{cpu_name()}-{cpu_features()}-{torch.get_num_threads()}-threads-torch-{torch.__version__}-{width}x{rows}"
    return Path(cache_dir or BF16_CACHE) / f"{file_name(key)}.json"


def bf16_choice(width: int = 512, rows: int = 2048, cache_dir: Path | None = None) -> tuple[bool, str]:
    """Whether to train in bf16 autocast on the device training will use, and why, in words: a GPU that supports bf16;
    on a CPU the kept calibration for the model's `width` (`calibrate`), else whether it has bf16 instructions."""
    if torch.cuda.is_available():
        return native_bfloat16("cuda")
    measured = read_kept(kept_path(width, rows, cache_dir))
    if measured is None or set(measured) != {"bfloat16", "float32"}:
        native, why = native_bfloat16("cpu")
        return native, f"{why}; not calibrated: `{PROG} --width {width}` times both"
    bf16_ms, fp32_ms = measured["bfloat16"], measured["float32"]
    return bf16_ms < fp32_ms, timings(width, rows, bf16_ms, fp32_ms) + ", calibrated on this CPU"


def timings(width: int, rows: int, bf16_ms: float, fp32_ms: float) -> str:
    return (f"a step of one MLP block ({width} wide, {rows} tokens) took {bf16_ms:.1f} ms with bf16 autocast, "
            f"{fp32_ms:.1f} ms in float32")


def calibrate(width: int = 512, rows: int = 2048, repeats: int = 5, cache_dir: Path | None = None) -> tuple[bool, str]:
    """Time one MLP block of the model's `width` over `rows` tokens, forward and backward, with and without autocast
    in turns (median of `repeats`), keep the result for `bf16_choice`, and return the choice and the timings."""
    bf16_ms, fp32_ms = time_mlp_step(width, rows, repeats)
    keep(kept_path(width, rows, cache_dir), {"bfloat16": bf16_ms, "float32": fp32_ms})
    return bf16_ms < fp32_ms, timings(width, rows, bf16_ms, fp32_ms)


def time_mlp_step(width: int, rows: int, repeats: int) -> tuple[float, float]:
    """Milliseconds of one MLP block's forward and backward over `rows` tokens, with and without bf16 autocast."""
    block = torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(approximate="tanh"),
                                torch.nn.Linear(4 * width, width))
    x = torch.randn(rows, width)

    def step(bf16: bool) -> float:
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = block(x).float().square().mean()
        loss.backward()
        return time.perf_counter() - start

    times = {True: [], False: []}
    for i in range(repeats + 1):  # the first round warms up
        for bf16 in (True, False):
            seconds = step(bf16)
            if i:
                times[bf16].append(seconds)
    return 1e3 * float(np.median(times[True])), 1e3 * float(np.median(times[False]))


def main(argv=None) -> bool:
    p = argparse.ArgumentParser(prog=PROG, description="Time a training step with and without bf16 autocast on this "
                                "CPU and keep the choice, which training runs with --bf16 unset read back.",
                                formatter_class=HelpFormatter)
    p.add_argument("--width", type=int, default=512, help="the model's n_embd (the cpu preset's oracle: 512)")
    p.add_argument("--rows", type=int, default=2048, help="tokens in the timed step")
    p.add_argument("--repeats", type=int, default=5, help="timed steps each way (their median counts)")
    args = p.parse_args(argv)
    if min(args.width, args.rows, args.repeats) < 1:
        p.error("--width, --rows and --repeats must be at least 1")
    if torch.cuda.is_available():
        print("a GPU trains in bf16 where it supports it; nothing to calibrate")
        return torch.cuda.is_bf16_supported()
    faster, measured = calibrate(args.width, args.rows, args.repeats)
    print(f"bf16 autocast {'on' if faster else 'off'} for width {args.width} on this CPU ({measured}); kept for training")
    return faster


if __name__ == "__main__":
    main()
