"""How a forward of a few new rows runs, measured: up to how many rows as one C++ call (native.Blocks) instead of
torch's operations, and whether that call's products run on AMX's tiles.

A forward of a few rows through torch starts some thirty operations a layer, each paying its own overhead; the C++
call pays once, and on a CPU with AVX-512 BF16 it ran the cpu preset's oracle over one token in about half torch's
time (docs/profiling.md, "The C++ forward"). Over many rows torch's products may win: where the two cross, if
they do, depends on the CPU, its threads and the model's width. On a CPU with AMX the C++ products can run on its
tiles instead of AVX-512's dot products, which pays from a few rows on. So every way is timed on the model itself
over ROW_COUNTS new rows by calibration (decode.calibrate, decode.plan), and the choice is kept per model, code and
device with the forward costs. Where a model was never calibrated, the C++ call runs up to native.Blocks.ROWS rows,
its products on the tiles where it can (native.Blocks.tiles) and as dot products elsewhere.
"""
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from decode.models.runtime import CPP, CPP_TILES, TORCH
from decode.timing.forwards import by_count, forward_costs
from decode.timing.kept import CACHE_DIR, cache_key, kept, read_kept

ROW_COUNTS = (1, 2, 4, 8, 16, 32, 64)
REPEATS = 10
# Rounds of timing every way in turn, each count's fastest kept: a burst of other work on the machine slows a
# round, not the choice
ROUNDS = 2
# The C++ call's ways of running its products, by the name its timings are kept under: on AMX's tiles or not
PRODUCTS = {CPP: False, CPP_TILES: True}


@dataclass(frozen=True)
class NativeForward:
    rows: int  # the most new rows a forward runs as the C++ call (0: none)
    tiles: bool  # whether that call's products run on AMX's tiles


def native_forward(model_dir, engine, dtype: str, cache_dir: Path | None = None, calibrate: bool = False
                   ) -> NativeForward:
    """The C++ call's products on whichever way took less time over ROW_COUNTS as a whole (the geometric mean of the
    ratios), and the largest of ROW_COUNTS up to which every timed forward was faster that way than in torch (0:
    never, or no C++ forward here; a quantized model's: all of them); timed with `calibrate` once per model, code,
    device and threads, then read back. Never timed: the runtime's own (native.Blocks.ROWS rows, the tiles where it
    can)."""
    runtime = engine.runtime
    if runtime.ways() == [TORCH]:
        return NativeForward(0, False)
    path = Path(cache_dir or CACHE_DIR) / f"native-rows-{cache_key(model_dir, engine, dtype)}.json"  # names the C++ too
    ways = [way for way in runtime.ways() if way != TORCH]

    def every_way() -> dict:
        ms: dict[str, dict[int, float]] = {}
        for _ in range(ROUNDS):
            for way in runtime.ways():
                with runtime.forced(way):
                    timed = forward_costs(engine, repeats=REPEATS, counts=ROW_COUNTS)
                ms[way] = {q: min(ms.get(way, {}).get(q, ms_now), ms_now) for q, ms_now in timed.items()}
        return ms

    measured = kept(path, every_way)[0] if calibrate else read_kept(path)
    if measured is None:
        return NativeForward(runtime.rows, runtime.tiles)
    ms = {way: by_count(row) for way, row in measured.items()}

    def against_dot_products(way: str) -> float:  # the mean log of the way's time over the dot products'
        return float(np.mean([np.log(ms[way][q] / ms[CPP][q]) for q in ms[CPP] if q in ms[way]]))

    best = min((way for way in ways if way in ms), key=against_dot_products)
    # a quantized model's C++ products quantize each row's inputs as llama.cpp does, and torch's forward, over the
    # dequantized weights, does not: its logits are another model's, so every forward stays in C++ however it times
    rivals = {} if runtime.quantization else ms[TORCH]
    rows = 0
    for q in ROW_COUNTS:
        if q not in ms[best] or ms[best][q] >= rivals.get(q, float("inf")):
            break
        rows = q
    return NativeForward(rows, PRODUCTS[best])
