"""Whether bf16 autocast speeds up training on this device: asked of a GPU, timed once on a CPU and kept."""
import json
import os
import time
from pathlib import Path

import numpy as np
import torch

from data.atomic import write_json
from data.machine import cpu_features, cpu_name

BF16_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "staged-speculative" / "bf16"


def bf16_is_faster(width: int = 512, rows: int = 2048, repeats: int = 5, cache_dir: Path | None = None
                   ) -> tuple[bool, str]:
    """Whether bf16 autocast makes a training step faster on the device training will use, and the timings: a GPU
    that supports bf16, or on a CPU one MLP block of the model's `width` over `rows` tokens, forward and backward,
    timed with and without autocast in turns (median of `repeats`), once per CPU, threads, torch and shape, then
    read back. A CPU with AVX2 alone emulates bf16: its autocast training ran over 100x slower there
    (docs/training.md)."""
    if torch.cuda.is_available():
        supported = torch.cuda.is_bf16_supported()
        return supported, "this GPU supports bf16" if supported else "this GPU lacks bf16"
    key = f"{cpu_name()}-{cpu_features()}-{torch.get_num_threads()}-threads-torch-{torch.__version__}-{width}x{rows}"
    path = Path(cache_dir or BF16_CACHE) / ("".join(c if c.isalnum() or c in ".-" else "_" for c in key) + ".json")
    try:
        bf16_ms, fp32_ms = json.loads(path.read_text())
        measured = "measured earlier on this CPU"
    except (OSError, ValueError, TypeError):
        bf16_ms, fp32_ms = time_mlp_step(width, rows, repeats)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json(path, [bf16_ms, fp32_ms])
        measured = "measured now"
    return bf16_ms < fp32_ms, (f"a step of one MLP block ({width} wide, {rows} tokens) took {bf16_ms:.1f} ms with bf16 "
                               f"autocast, {fp32_ms:.1f} ms in float32, {measured}")


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
