"""What a quantized model loses: its perplexity beside the 16-bit model's, on a run's validation tokens, computed by the
engine decoding runs (the C++ forward where it runs)."""
import json
import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from decode.errors import InputError
from decode.models.cached_lm import CachedLM


def validation_windows(data_dir: Path, tokens: int, window: int) -> list[list[int]]:
    """The first `tokens` tokens of a prepared data directory's validation split (data.prepare's val.bin, its dtype
    in meta.json), in windows of `window` tokens, each read from an empty cache."""
    meta_path, path = Path(data_dir) / "meta.json", Path(data_dir) / "val.bin"
    try:
        dtype = np.dtype(json.loads(meta_path.read_text())["dtype"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise InputError(f"{meta_path} cannot be read ({err}); prepare the data again (python -m data.prepare)") from None
    if not path.is_file():
        raise InputError(f"{data_dir} has no validation split ({path.name}); prepare the data again (python -m data.prepare)")
    ids = np.fromfile(path, dtype=dtype, count=tokens).astype(np.int64)
    return [ids[i : i + window].tolist() for i in range(0, len(ids) - 1, window) if len(ids[i : i + window]) > 1]


def perplexity(model: CachedLM, windows: list[list[int]]) -> float:
    """exp of the mean negative log-likelihood of each window's tokens after its first, each window from an empty
    cache."""
    total, count = 0.0, 0
    for window in windows:
        model.length = model.pending = 0
        logits = model.forward(window[:-1], list(range(len(window) - 1)), None)
        total += F.cross_entropy(logits.float(), torch.tensor(window[1:]), reduction="sum").item()
        count += len(window) - 1
    model.length = model.pending = 0
    return math.exp(total / count)
