"""Keeping what was measured: a measurement is kept as JSON in the user's cache under a key of everything it depends
on (`cache_key`: the model, the code that ran it, the device, its threads), so later runs read it back instead of
timing again."""
import hashlib
import inspect
import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from decode.atomic import write_json
from decode.devices import device_name
from decode.fingerprint import CACHE_ROOT, fingerprint
from decode.timing.forwards import forward_costs

if TYPE_CHECKING:
    from decode.models.cached_lm import CachedLM

CACHE_DIR = CACHE_ROOT / "forward-costs"


def cache_key(model_dir, model: "CachedLM", dtype: str) -> str:
    """Model (its fingerprint), the backend's code (with the C++ forward's, where it runs one) and the timing's, weight
    layout, CUDA graphs and output shortlist, device, dtype and threads."""
    backend = Path(inspect.getfile(type(model))).read_text() + inspect.getsource(forward_costs) + model.runtime.key()
    layouts, graphs = getattr(model, "layouts", None), getattr(model, "graphs", None) is not None
    shortlist = None if model.shortlist is None else model.shortlist.tokens.tolist()
    digest = hashlib.sha256(json.dumps([fingerprint(model_dir), backend, layouts, graphs, torch.__version__]
                                       + ([shortlist] if shortlist is not None else [])).encode()).hexdigest()[:16]
    return f"{digest}-{file_name(device_name(model.device))}-{dtype}"


def read_kept(path: Path) -> dict | None:
    """The measurement kept at `path` (JSON), or None."""
    try:
        measured = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return measured if isinstance(measured, dict) else None


def keep(path: Path, measured: dict) -> dict:
    """`measured`, kept at `path` (JSON) in place of what was."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, measured, indent=1, overwrite=True)
    return measured


def kept(path: Path, measure: Callable[[], dict]) -> tuple[dict, bool]:
    """The measurement kept at `path` (JSON), or `measure()`'s, kept there now; and whether it was read back."""
    measured = read_kept(path)
    if measured is not None:
        return measured, True
    return keep(path, measure()), False


def file_name(text: str) -> str:
    """`text` as part of a file's name: every character but letters and digits as "_"."""
    return "".join(c if c.isalnum() else "_" for c in text)
