"""How a linear layer multiplies: the weight's layout (Hugging Face's Conv1D (in, out), torch's (out, in), or oneDNN's
prepacked), picked per matrix shape on a CPU by calibration (decode.calibrate, decode.plan), which keeps each
choice; where a shape was never calibrated, default_layout's."""
import functools
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from decode.devices import device_name
from decode.timing.kept import CACHE_DIR, file_name, kept, read_kept

# On a CPU in bfloat16, oneDNN builds a kernel for every new number of rows a matrix is multiplied with, which made
# each first prompt of a new length cost more than the next of that length. Products of more than PAD_ABOVE rows
# (prompts; the trees a step scores are smaller) are padded to a multiple of ROW_BLOCK, so prompts of any length
# share a few kernels.
PAD_ABOVE, ROW_BLOCK = 64, 32


# How a linear layer multiplies its input by a weight matrix: addmm over Hugging Face's Conv1D (in, out)
# layout, F.linear over (out, in), or oneDNN's matmul over (out, in) prepacked in its blocked layout (private
# ops, inductor's). Which is fastest depends on the device and the matrix's shape: on CPUs it is measured.
LAYOUTS = ("in_out", "out_in", "packed")


def default_layout(dtype: torch.dtype) -> str:
    """A GPU's layout, and a CPU's where not calibrated: F.linear's in bfloat16, addmm's otherwise."""
    return "out_in" if dtype == torch.bfloat16 else "in_out"


def layout_for(dtype: torch.dtype, device: torch.device, in_features: int, out_features: int, gelu: bool = False,
               calibrate: bool = False, cache_dir: Path | None = None) -> str:
    """The layout a matrix of this shape is stored in on `device` (a CPU: a GPU's runtime takes default_layout's): the
    calibrated one (measured now with `calibrate`, by fastest_layout, and kept per CPU, threads and torch), else
    default_layout's."""
    machine = file_name(f"{device_name(device)}-torch-{torch.__version__}")
    name = f"layout-{machine}-{str(dtype).removeprefix('torch.')}-{in_features}x{out_features}{'-gelu' * gelu}.json"
    path = Path(cache_dir or CACHE_DIR) / name
    if calibrate:
        return kept(path, lambda: {"layout": fastest_layout(dtype, in_features, out_features, gelu)})[0]["layout"]
    return (read_kept(path) or {}).get("layout", default_layout(dtype))


@functools.cache
def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN's prepacked linear runs here in this dtype (bfloat16 needs AVX-512 or AVX-NE-CONVERT:
    an AVX2-only CPU refuses it)."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    try:
        weight = torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8, dtype=dtype))
        torch.ops.mkldnn._linear_pointwise(torch.zeros(1, 8, dtype=dtype), weight, None, "none", [], "")
    except RuntimeError:
        return False
    return True


class Projection:
    """x @ weight + bias, the (in, out) weight stored in one of LAYOUTS, then GPT-2's tanh GELU when `gelu`; the
    product is picked once, not per call. Prepacked, oneDNN applies the GELU to the product's float32 accumulator
    as it writes it out: one pass fewer over the MLP's widest activations. The separate GELU
    rounds the product to the dtype first, so the two can differ in the last place."""

    def __init__(self, in_out: torch.Tensor, bias: torch.Tensor | None, layout: str, gelu: bool = False,
                 pad_rows: bool = False):
        self.layout, self.pad_rows = layout, pad_rows  # pad_rows: past PAD_ABOVE rows, to a multiple of ROW_BLOCK
        if layout == "packed":
            self.weight = torch.ops.mkldnn._reorder_linear_weight(in_out.T.contiguous())
            attr, algorithm = ("gelu", "tanh") if gelu else ("none", "")
            self.multiply = lambda x: torch.ops.mkldnn._linear_pointwise(x, self.weight, bias, attr, [], algorithm)
            return
        if layout == "in_out":
            self.weight = in_out
            product = (lambda x: x @ in_out) if bias is None else functools.partial(torch.addmm, bias, mat2=in_out)
        else:
            self.weight = in_out.T.contiguous()
            product = functools.partial(F.linear, weight=self.weight, bias=bias)
        self.multiply = (lambda x: F.gelu(product(x), approximate="tanh")) if gelu else product

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if self.pad_rows and rows > PAD_ABOVE and rows % ROW_BLOCK:
            return self.multiply(F.pad(x, (0, 0, 0, ROW_BLOCK - rows % ROW_BLOCK)))[:rows]
        return self.multiply(x)


@functools.cache
def fastest_layout(dtype: torch.dtype, in_features: int, out_features: int, gelu: bool = False) -> str:
    """The layout whose product of 1 and of 16 rows by a matrix of this shape (and its GELU, with `gelu`) takes
    least time on this CPU. It differs by kind and shape: oneDNN's prepacked product wins for wide matrices and
    loses for small ones, where its fixed cost per call dominates (docs/profiling.md); bfloat16 cannot be prepacked
    on a CPU with AVX2 alone. Every candidate is called once before the timing (its first call builds kernels), then
    the candidates take turns, so a drift of the machine's speed during the measurement weighs on all of them alike,
    and a candidate's first call cannot make it look slow."""
    weight = torch.randn(in_features, out_features, generator=torch.Generator().manual_seed(0)).to(dtype)
    bias = torch.zeros(out_features, dtype=dtype)
    cases = [(layout, Projection(weight, bias, layout, gelu), torch.ones(rows, in_features, dtype=dtype))
             for layout in LAYOUTS if layout != "packed" or onednn_packs(dtype) for rows in (1, 16)]
    samples: list[list[float]] = [[] for _ in cases]
    for _, projection, x in cases:
        projection(x)
    for _ in range(12):
        for (_, projection, x), timings in zip(cases, samples):
            start = time.perf_counter()
            projection(x)
            timings.append(time.perf_counter() - start)
    times: dict[str, float] = {}
    for (layout, _, _), timings in zip(cases, samples):
        times[layout] = times.get(layout, 0.0) + sorted(timings)[len(timings) // 2]
    return min(times, key=times.__getitem__)
