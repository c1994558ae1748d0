"""What a forward pass costs on this device, measured: the input to sizing speculative trees.

`measured_costs` times a model's forwards (decode.timing.forward_costs) after a number of cached positions, once
per model, device, dtype, thread count and that number, and keeps the table in a cache file, so later runs read it.
`cost_curve` interpolates a table to every q; `ContextCosts` holds curves measured after several cached lengths and
prices a forward of q nodes after any number of them.
"""
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from decode.errors import InputError
from decode.models.cached_lm import CachedLM
from decode.models.quantized import Format, QuantizedMatrix
from decode.shortlist import Shortlist
from decode.timing.forwards import by_count, forward_costs
from decode.timing.kept import CACHE_DIR, cache_key, kept

# The node counts a forward is timed at for planning: the powers of two, and 17, 33 and 48, past which a product
# that takes rows in tiles of 16 (AMX's, two of them a pass over the weights) starts another tile or pass: the cost
# steps up there, which interpolating between powers of two would spread over the counts below (docs/planning.md)
PLANNED_COUNTS = (1, 2, 4, 8, 16, 17, 32, 33, 48, 64)


def measured_costs(model_dir, model: CachedLM, dtype: str, counts=PLANNED_COUNTS,
                   cache_dir: Path | None = None, prefix: int = 128) -> tuple[dict[int, float], bool]:
    """The forward-cost table of this model on this device after `prefix` cached positions, from the cache or
    measured now; and whether it came from the cache."""
    suffix = "" if prefix == 128 else f"-after-{prefix}"
    name = f"{cache_key(model_dir, model, dtype)}-{'-'.join(map(str, counts))}{suffix}.json"
    path = Path(cache_dir or CACHE_DIR) / name
    costs, read = kept(path, lambda: forward_costs(model, prefix=prefix, counts=counts))
    return by_count(costs), read


def context_lengths(max_length: int) -> tuple[int, int]:
    """The cached lengths a model's costs are measured after for planning: 128, and half its context (at least 256),
    between which (and past which) attention's cost grows linearly."""
    return 128, max(256, max_length // 2)


class ContextCosts:
    """Milliseconds of a forward of q nodes after c cached positions: the cost curves (`cost_curve`) measured after
    a few cached lengths, interpolated linearly in c between them and extrapolated linearly past the longest (the
    attention over the cache is the part that grows, linearly); below the shortest, that one's curve."""

    def __init__(self, curves: dict[int, torch.Tensor]):
        self.lengths = sorted(curves)
        self.curves = torch.stack([curves[c].double() for c in self.lengths])  # (lengths, q)

    @classmethod
    def of_tables(cls, tables: dict[int, dict[int, float]], largest: int) -> "ContextCosts":
        """From cost tables measured after several cached lengths: each one's `cost_curve` up to `largest` nodes."""
        return cls({cached: cost_curve(table, largest) for cached, table in tables.items()})

    @classmethod
    def flat(cls, curve: torch.Tensor) -> "ContextCosts":
        """One curve for every cached length."""
        return cls({0: curve})

    def __mul__(self, factor: float) -> "ContextCosts":
        return ContextCosts({c: curve * factor for c, curve in zip(self.lengths, self.curves)})

    __rmul__ = __mul__

    def at(self, nodes: Sequence[int], cached: Sequence[int]) -> torch.Tensor:
        """The cost of each forward of nodes[i] nodes after cached[i] positions."""
        q = torch.tensor(nodes, dtype=torch.long)
        if len(self.lengths) == 1:
            return self.curves[0, q]
        c = torch.tensor(cached, dtype=torch.float64).clamp_min(self.lengths[0])
        lengths = torch.tensor(self.lengths, dtype=torch.float64)
        upper = torch.searchsorted(lengths, c, right=True).clamp(1, len(self.lengths) - 1)  # the segment c lies in
        lower = upper - 1
        weight = (c - lengths[lower]) / (lengths[upper] - lengths[lower])
        return self.curves[lower, q] + weight * (self.curves[upper, q] - self.curves[lower, q])


def non_decreasing(values) -> np.ndarray:
    """The non-decreasing sequence nearest `values` in least squares (pool adjacent violators): neighbours out of
    order are replaced by their mean until none is."""
    pools = []  # [mean, count]
    for value in values:
        pools.append([float(value), 1.0])
        while len(pools) > 1 and pools[-2][0] > pools[-1][0]:
            (mean, count), (last, last_count) = pools[-2], pools.pop()
            pools[-1] = [(mean * count + last * last_count) / (count + last_count), count + last_count]
    return np.repeat([mean for mean, _ in pools], [int(count) for _, count in pools])


def cost_curve(costs: dict[int, float], largest: int) -> torch.Tensor:
    """Milliseconds for q = 0 .. largest nodes, interpolated linearly between measured counts (and
    extrapolated with the last segment's slope beyond them); entry 0 is 0. A forward of more nodes does the
    work of one of fewer and more, so the measured table is first fitted non-decreasing (`non_decreasing`): on a
    busy machine a count timed at a worse moment can come out above a larger one."""
    qs = np.array(sorted(costs))
    ms = non_decreasing([costs[q] for q in qs])
    q = np.arange(largest + 1)
    curve = np.interp(q, qs, ms)
    if len(qs) > 1 and largest > qs[-1]:
        slope = (ms[-1] - ms[-2]) / (qs[-1] - qs[-2])
        curve[q > qs[-1]] = ms[-1] + slope * (q[q > qs[-1]] - qs[-1])
    curve[0] = 0.0
    return torch.tensor(curve)


# GPT-2's sizes, and the paper preset's distilled draft (4 x 512 over GPT-2's vocabulary: 38M parameters)
PROJECTIONS = {"gpt2": (12, 768, 50257), "gpt2-medium": (24, 1024, 50257), "gpt2-large": (36, 1280, 50257),
               "gpt2-xl": (48, 1600, 50257), "draft-40m": (4, 512, 50257)}


def projection_shape(spec: str, flag: str = "--project-oracle") -> tuple[int, int, int]:
    """(n_layer, n_embd, vocab_size) from a GPT-2 name or 'n_layer,n_embd,vocab'."""
    if spec in PROJECTIONS:
        return PROJECTIONS[spec]
    try:
        n_layer, n_embd, vocab = (int(x) for x in spec.split(","))
    except ValueError:
        n_layer = 0
    if n_layer < 1 or n_embd < 64 or n_embd % 64 or vocab < 2:
        raise InputError(f"{flag} {spec!r}: name one of {', '.join(PROJECTIONS)} or give n_layer,n_embd,vocab "
                         f"(n_embd a multiple of 64, the head size), e.g. 36,1280,50257")
    return n_layer, n_embd, vocab


def random_weights(n_layer: int, n_embd: int, vocab_size: int, n_positions: int = 1024,
                   dtype: torch.dtype = torch.bfloat16) -> tuple[dict, dict[str, torch.Tensor]]:
    """A GPT-2 config of this shape (64-wide heads) and random weights for it, named as in a checkpoint."""
    e = n_embd
    config = {"vocab_size": vocab_size, "n_positions": n_positions, "n_layer": n_layer, "n_head": e // 64,
              "n_embd": e, "layer_norm_epsilon": 1e-5}
    shapes = {"wte.weight": (vocab_size, e), "wpe.weight": (n_positions, e), "ln_f.weight": (e,), "ln_f.bias": (e,)}
    for i in range(n_layer):
        shapes |= {f"h.{i}.{name}": shape for name, shape in {
            "ln_1.weight": (e,), "ln_1.bias": (e,), "ln_2.weight": (e,), "ln_2.bias": (e,),
            "attn.c_attn.weight": (e, 3 * e), "attn.c_attn.bias": (3 * e,), "attn.c_proj.weight": (e, e),
            "attn.c_proj.bias": (e,), "mlp.c_fc.weight": (e, 4 * e), "mlp.c_fc.bias": (4 * e,),
            "mlp.c_proj.weight": (4 * e, e), "mlp.c_proj.bias": (e,)}.items()}
    return config, {name: 0.02 * torch.randn(shape, dtype=dtype) for name, shape in shapes.items()}


def random_model(spec: str, dtype: str, device: str, cuda_graphs: bool = False, compile_layers: bool = False):
    """A model of a --shape (shape_of's) with random weights, its forward of a few rows in C++ where it can: a GPT-2
    (random_gpt2) or a Llama-family model (decode.models.llama.SHAPES); its runtime's `cuda_graphs` and
    `compile_layers` as the engines' build takes them."""
    from decode.models.llama import SHAPES, LlamaEngine, random_checkpoint

    if spec in SHAPES:
        return LlamaEngine.build(SHAPES[spec], random_checkpoint(SHAPES[spec]), dtype, device, cuda_graphs=cuda_graphs,
                                 native_blocks=True, compile_layers=compile_layers)
    return random_gpt2(*projection_shape(spec, "--shape"), dtype, device, cuda_graphs=cuda_graphs,
                       compile_layers=compile_layers)


def random_gpt2(n_layer: int, n_embd: int, vocab_size: int, dtype: str, device: str, n_positions: int = 1024,
                cuda_graphs: bool = False, native_blocks: bool = True, shortlist: int = 0,
                quantization: Format | None = None, compile_layers: bool = False):
    """A GPT-2 of this shape with random weights (`random_weights`): its forward costs what a trained
    one's does. With `native_blocks`, a forward of up to native.Blocks.ROWS rows runs as the C++ call where it can;
    with a `shortlist`, its output layer covers that many tokens (decode.run --draft-vocab); with a `quantization`,
    its matrices are in that block format."""
    from decode.models.engine import GPT2Engine
    from decode.models.quantize_model import is_quantized_matrix, oriented

    config, weights = random_weights(n_layer, n_embd, vocab_size, n_positions)
    tokens = Shortlist(torch.arange(shortlist), vocab_size) if shortlist else None
    quantized = {name: QuantizedMatrix.quantize(oriented(name, weights.pop(name)), quantization)
                 for name in list(weights) if is_quantized_matrix(name)} if quantization else None
    return GPT2Engine.build(config, weights, dtype, device, cuda_graphs=cuda_graphs, native_blocks=native_blocks,
                            shortlist=tokens, quantized=quantized, compile_layers=compile_layers)
