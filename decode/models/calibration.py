"""Calibration: what a machine measures once about a model and keeps, so that checking options and loading a model time
nothing. Three choices are measured: the dtype "auto" stands for (decode.models.precision), the layout each weight
matrix is stored in (decode.models.projection), and up to how many rows a forward runs as the C++ call
(decode.models.native_rows). `python -m decode.calibrate` takes them, and decode.plan takes them before it plans;
every other command reads what was kept, and uses each choice's documented default where nothing was.
"""
from pathlib import Path

from decode.errors import check_path
from decode.models.loading import draft_precision, load_model


def calibrate(options) -> dict[str, str]:
    """Measure and keep, for the options' oracle and draft on their device, in the dtype each decodes in, every weight
    matrix's layout and the C++ forward's rows (the dtype itself is calibrated where "auto" is resolved: auto_dtype);
    per model, what was chosen, in words."""
    check_path(options.oracle, True, "oracle directory", "pass --run RUN or --oracle DIR")
    chosen = {}
    for role, directory, (dtype, quantization) in (("oracle", options.oracle, (options.dtype, None)),
                                                   ("draft", options.draft, draft_precision(options))):
        if directory is not None and Path(directory).is_dir():
            model = load_model(Path(directory), options.backend, dtype, options.device, calibrate=True,
                               quantization=quantization)
            chosen[role] = describe(model, dtype if quantization is None else f"{quantization.name} in {dtype}")
    return chosen


def describe(model, dtype: str) -> str:
    layouts = getattr(model, "layouts", None)
    if layouts is None:
        return f"{dtype}, the transformers backend (nothing to calibrate)"
    rows, tiles = model.runtime.rows, model.runtime.tiles
    forward = f"the C++ forward up to {rows} rows{' on AMX tiles' if tiles else ''}" if rows else "torch's forward"
    return f"{dtype}, {forward}, layouts " + ", ".join(f"{part} {layout}" for part, layout in layouts.items())
