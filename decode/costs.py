"""What a forward pass costs on this device, measured: the input to sizing speculative trees.

`forward_costs` times one forward of q chained nodes after a cached prefix. `measured_costs` does that
once per model, device, dtype and thread count and keeps the table in a cache file, so later runs read
it. `cost_curve` interpolates the table to every q.
"""
import hashlib
import inspect
import json
import os
import time
from pathlib import Path

import numpy as np
import torch

from data.atomic import atomic_output
from decode.cached_lm import CachedLM
from decode.tree import Tree

NODE_COUNTS = (1, 2, 4, 8, 16, 32, 64)
DRAFT_NODE_COUNTS = NODE_COUNTS + (128, 256, 512, 1024, 2048)  # the draft scores the trigram's whole tree
CACHE_DIR = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "staged-speculative" / "forward-costs"


def synchronize(device: torch.device) -> None:
    """Wait for queued GPU work, so a timer sees it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bushy_tree(q: int) -> Tree:
    """q nodes, three children per node, level by level: the shape of a drafted tree."""
    tree = Tree.rooted(0)
    for node in range(1, q):
        tree.add((node - 1) // 3, node)
    return tree


def forward_costs(model: CachedLM, prefix: int = 128, repeats: int = 20, counts=NODE_COUNTS,
                  tree: bool = False) -> dict[int, float]:
    """Milliseconds per forward of q nodes after `prefix` cached positions (at most half the context;
    median of repeats). The nodes form a chain, the costliest shape for attention, with the model's
    default causal mask; with `tree=True` a three-children-per-node tree with its explicit mask (to
    compare the two). Positions stop at the context's end (a tree's nodes share positions, so a tree
    can hold more nodes than the context has positions)."""
    costs = {}
    prefix = min(prefix, model.max_length // 2)
    for q in (q for q in counts if prefix + q <= getattr(model, "capacity", model.max_length)):
        model.reset()
        model.extend(torch.randint(0, model.vocab_size, (prefix,), device=model.device))
        ids = torch.randint(0, model.vocab_size, (q,), device=model.device)
        positions = torch.arange(prefix, prefix + q, device=model.device).clamp(max=model.max_length - 1)
        mask = None
        if tree:
            shape = bushy_tree(q)
            positions, mask = shape.position_ids(prefix, model.device), shape.mask(model.device)
        times = []
        for _ in range(repeats + 1):  # the first call warms up
            synchronize(model.device)
            start = time.perf_counter()
            model.forward(ids, positions, mask)
            synchronize(model.device)
            times.append(time.perf_counter() - start)
            model.commit([])
        costs[q] = 1e3 * float(np.median(times[1:]))
    model.reset()
    return costs


def cache_key(model_dir, model: CachedLM, dtype: str) -> str:
    """Model (path and weight files' size and time), the backend's code, device, dtype and threads."""
    model_dir = Path(model_dir).resolve()
    files = sorted(f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in model_dir.glob("*.safetensors"))
    backend = Path(inspect.getfile(type(model))).read_text()
    device = torch.cuda.get_device_name(model.device) if model.device.type == "cuda" else f"cpu-{torch.get_num_threads()}threads"
    digest = hashlib.sha256(json.dumps([str(model_dir), files, backend, torch.__version__]).encode()).hexdigest()[:16]
    return f"{digest}-{device.replace(' ', '_')}-{dtype}"


def measured_costs(model_dir, model: CachedLM, dtype: str, counts=NODE_COUNTS,
                   cache_dir: Path | None = None) -> tuple[dict[int, float], bool]:
    """The forward-cost table of this model on this device, from the cache or measured now; and
    whether it came from the cache."""
    path = Path(cache_dir or CACHE_DIR) / f"{cache_key(model_dir, model, dtype)}-{max(counts)}.json"
    if path.is_file():
        return {int(q): ms for q, ms in json.loads(path.read_text()).items()}, True
    costs = forward_costs(model, counts=counts)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_output(path) as tmp:
        tmp.write_text(json.dumps(costs, indent=1) + "\n")
    return costs, False


def cost_curve(costs: dict[int, float], largest: int) -> torch.Tensor:
    """Milliseconds for q = 0 .. largest nodes, interpolated linearly between measured counts (and
    extrapolated with the last segment's slope beyond them); entry 0 is 0."""
    qs, ms = np.array(sorted(costs)), np.array([costs[q] for q in sorted(costs)])
    q = np.arange(largest + 1)
    curve = np.interp(q, qs, ms)
    if len(qs) > 1 and largest > qs[-1]:
        slope = (ms[-1] - ms[-2]) / (qs[-1] - qs[-2])
        curve[q > qs[-1]] = ms[-1] + slope * (q[q > qs[-1]] - qs[-1])
    curve[0] = 0.0
    return torch.tensor(curve)
