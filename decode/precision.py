"""Which dtype a decoder runs in when asked for "auto": bfloat16 where the device multiplies in it natively, float32
elsewhere.

A batch-one forward streams every weight, so bfloat16 halves the bytes; but on a CPU without bfloat16 instructions
the products are emulated, and a tree of 16 nodes then costs ten times one token (docs/decoding.md, "Precision").
A GPU with bfloat16 support and a CPU with AVX-512 BF16 or AMX multiply in it natively.
"""
import json
import os
from pathlib import Path

import torch

from decode.costs import cpu_features, device_name

DTYPES = ("float32", "bfloat16")
PINNED = "STAGED_SPECULATIVE_DTYPE"  # what "auto" resolves to when set (float32 or bfloat16): reproducible runs


def auto_dtype(device: str, plan: Path | None = None) -> tuple[str, str]:
    """The dtype "auto" stands for on `device`, and why, in a few words: the dtype the `plan` file (RUN/plan.json)
    was planned in on this device (the planner measured these models there), else the device's native support for
    bfloat16."""
    pinned = os.environ.get(PINNED)
    if pinned in DTYPES:
        return pinned, f"{PINNED}={pinned}"
    planned = plan_dtype(plan, device) if plan is not None else None
    if planned is not None:
        return planned, f"{plan} was planned in it on this device"
    if torch.device(device).type == "cuda":
        if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
            return "bfloat16", "this GPU supports it"
        return "float32", "this GPU lacks bfloat16"
    features = cpu_features()
    if "BF16" in features or "AMX" in features:
        return "bfloat16", f"this CPU multiplies in it natively ({features})"
    return "float32", "this CPU has no bfloat16 instructions, so bfloat16 would be emulated"


def plan_dtype(plan: Path, device: str) -> str | None:
    """The dtype a plan file was measured in, when it was measured on this device; else None."""
    try:
        identity = json.loads(Path(plan).read_text())["identity"]
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError):
        return None
    if identity.get("device") != device_name(torch.device(device)) or identity.get("dtype") not in DTYPES:
        return None
    return identity["dtype"]
