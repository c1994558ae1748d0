"""Up to how many new rows a forward runs as one C++ call (native.Blocks) instead of torch's operations, measured.

A forward of a few rows through torch starts some thirty operations a layer, each paying its own overhead; the C++
call pays once, and on a CPU with AVX-512 BF16 it ran the cpu preset's oracle over one token in about half torch's
time (docs/profiling.md, "The C++ forward"). Over many rows torch's products may win: where the two cross, if
they do, depends on the CPU, its threads and the model's width, so both are timed on the model itself over
ROW_COUNTS new rows and the choice is kept per model, code and device with the forward costs.
"""
from pathlib import Path

from decode.planning.costs import CACHE_DIR, by_count, cache_key, forward_costs, kept

ROW_COUNTS = (1, 2, 4, 8, 16, 32, 64)
REPEATS = 10


def native_rows(model_dir, engine, dtype: str, cache_dir: Path | None = None) -> int:
    """The largest of ROW_COUNTS up to which every timed forward of `engine` was faster in C++ (0: never, or no C++
    forward here); timed once per model, code, device and threads, then read back."""
    if engine.blocks is None:
        return 0
    path = Path(cache_dir or CACHE_DIR) / f"native-rows-{cache_key(model_dir, engine, dtype)}.json"  # names the C++ too

    def both_ways() -> dict:
        ms, before = {}, engine.native_rows
        for way, rows in (("C++", max(ROW_COUNTS)), ("torch", 0)):
            engine.native_rows = rows
            ms[way] = forward_costs(engine, repeats=REPEATS, counts=ROW_COUNTS)
        engine.native_rows = before
        return ms

    measured, _ = kept(path, both_ways)
    ms = {way: by_count(row) for way, row in measured.items()}
    chosen = 0
    for q in ROW_COUNTS:
        if q not in ms["C++"] or ms["C++"][q] >= ms["torch"].get(q, float("inf")):
            break
        chosen = q
    return chosen
