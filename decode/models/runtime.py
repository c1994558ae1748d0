"""What runs a model on its device, chosen once as the model is built: one `Runtime` per device and model.

A runtime owns every choice that depends on where a loaded model runs, so that the models, the drafters, the loops
and the tools never ask which device or instruction set they are on:

    kernels                  the step's loops over the model's logits (decode.kernels: C++ or portable)
    dtype, quantization      the activations' and the cache's dtype (bfloat16 or float32), and the weights' block
                             format where they are quantized (decode.models.quantized: Q8_0, Q4_0), else that dtype
    blocks, rows             the C++ forward of a few rows (native.Blocks) and the most rows it runs (0: torch's forward)
    tiles                    whether that forward's products run on AMX's tiles
    mover(cache)             a commit's moves of KV slots
    layout(...), pads_rows   how the weights are stored for torch's products
    attention(), graphs()    torch's attention kernels, CUDA graphs
    layer(block)             the function torch's forward computes a layer with: the engine's own, or compiled
    forced(way)              a context in which the forwards run one way ("torch", "C++", "C++ on AMX tiles"), for
                             the tools that compare them

The loops over token lists and the trigram's tables run in CPU memory whatever the device: `host_kernels()`.

Three kinds, as ggml's CPU and CUDA backends: `Runtime` (torch's operations and the portable loops on a CPU, where
the C++ is not built), `NativeRuntime` (a CPU with the C++ loops, and the C++ forward where the instruction set and
the model allow it) and `CudaRuntime` (a GPU: portable loops over its logits, CUDA graphs, SDPA without cuDNN).
`runtime_for` picks one.
"""
import contextlib
import functools
from collections.abc import Callable

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from decode import native
from decode.kernels import NativeKernels, PortableKernels, StepKernels
from decode.models.cuda_graphs import CUDAGraphs
from decode.models.projection import default_layout, layout_for
from decode.models.quantized import Format

TORCH, CPP, CPP_TILES = "torch", "C++", "C++ on AMX tiles"  # the ways a forward of a few rows can run
# cuDNN's attention builds a plan for every new shape, and each decoding call has a new cached length, which made
# greedy decoding on a GPU an order of magnitude slower (docs/gpu.md)
ATTENTION_WITHOUT_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
Mover = Callable[[int, list[int]], None]  # (length, keep): pending slot keep[i] becomes slot length + i


@functools.cache
def host_kernels() -> StepKernels:
    """The loops over data in CPU memory (token lists, the trigram's successor tables), whatever device the models are
    on: C++ where it is built (decode.native), else the portable code."""
    return NativeKernels() if native.module() is not None else PortableKernels()


# How a layer is compiled, set for the process as the first layer compiles (torch reads these only as it traces, so
# that a call costs nothing more; a decoding process compiles nothing else): no duck sizing (sizes equal when first
# traced taken for one symbol, as a bucket of 2 rows for the cache's 2 planes: a later bucket recompiled in the middle
# of a decoding), and room for every variant that an oracle's and a draft's layers trace (one row or more, a mask or
# none, slots as a range or a tensor, each model's own constants) before torch falls back to running them uncompiled
RECOMPILE_LIMIT = 64


@functools.cache
def compiled(block: Callable) -> Callable:
    """`block` through torch.compile, its shapes symbolic: the rows and cached slots of every forward share a graph."""
    native.note_once("the lean engine's layers compile (torch.compile) as they first run: the first forwards take tens "
                     "of seconds, later starts read inductor's cache")
    torch.fx.experimental._config.use_duck_shape = False
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    return torch.compile(block, dynamic=True)


def torch_mover(cache: torch.Tensor) -> Mover:
    """A commit's moves as torch copies over a (..., capacity, head_dim) cache. Slots already in place stay: drafters
    put a tree's likeliest path first (Tree.subtree), so an accepted path is often all in place, and the rest of it,
    numbered depth first, holds runs of consecutive slots. Each run is copied as one block, split where it would
    overlap its destination. Right after a forward, copying slot by slot is faster than one index_select of the slots
    (which allocates and gathers every plane), and blocks cut the copies further."""
    slots = cache.dim() - 2

    def move(length: int, keep: list[int]) -> None:
        n = len(keep)
        start = next((i for i, slot in enumerate(keep) if slot != i), n)
        while start < n:
            end = start + 1
            while end < n and keep[end] == keep[end - 1] + 1 and end < keep[start]:
                end += 1
            cache.narrow(slots, length + start, end - start).copy_(cache.narrow(slots, length + keep[start], end - start))
            start = end

    return move


class Runtime:
    """torch's operations and the portable loops, on a CPU (the base of the other kinds)."""

    name = "torch"

    def __init__(self, device: torch.device, dtype: torch.dtype, quantization: Format | None = None,
                 compile_layers: bool = False):
        self.device, self.dtype, self.quantization, self.compile_layers = device, dtype, quantization, compile_layers
        self.kernels: StepKernels = PortableKernels()
        self.blocks: native.Blocks | None = None
        self.rows = 0

    @property
    def tiles(self) -> bool:
        return False

    @property
    def weight_bytes(self) -> float:
        """Bytes a weight of the matrices takes in memory, as a forward reads it."""
        return self.quantization.bits / 8 if self.quantization else self.dtype.itemsize

    @property
    def chunks(self) -> bool:
        """Whether a forward of more rows than one C++ call takes runs as several such calls."""
        return False

    def loads_forward(self, n_embd: int) -> bool:
        """Whether `load_forward` makes a C++ forward for a model of this width here."""
        return False

    def load_forward(self, shape: dict, tensors: dict, output: "torch.Tensor | native.QuantizedWeight",
                     consume: bool) -> None:
        """Make the C++ forward of a model of this shape over these tensors (native.Blocks' arguments), where
        `loads_forward` says so."""
        raise NotImplementedError(f"the {self.name} runtime has no C++ forward")

    def mover(self, cache: torch.Tensor) -> Mover:
        return torch_mover(cache)

    def layout(self, in_features: int, out_features: int, gelu: bool, calibrate: bool) -> str:
        """The layout a weight matrix of this shape is stored in for torch's products (decode.models.projection): the
        calibrated one, but for oneDNN's prepacked one where the layers compile (inductor does not lower its product
        over a varying number of rows)."""
        chosen = layout_for(self.dtype, self.device, in_features, out_features, gelu, calibrate)
        return default_layout(self.dtype) if chosen == "packed" and self.compile_layers else chosen

    def pads_rows(self) -> bool:
        """Whether torch's products pad a prompt's rows (oneDNN builds a kernel per row count in bfloat16 on a CPU)."""
        return self.dtype == torch.bfloat16

    def attention(self) -> contextlib.AbstractContextManager:
        """The context torch's attention runs in (transformers' models too)."""
        return contextlib.nullcontext()

    def graphs(self, engine) -> CUDAGraphs | None:
        """The engine's CUDA graphs, where the device replays them."""
        return None

    def layer(self, block: Callable) -> Callable:
        """What torch's forward computes each layer with: the engine's `block`, or with `compile_layers` that function
        compiled by torch.compile (its small operations fused into fewer kernels, as one graph whatever the number of
        rows and cached slots, compiled on first use)."""
        return compiled(block) if self.compile_layers else block

    def synchronize(self) -> None:
        """Wait for queued device work, so a timer sees it."""

    def ways(self) -> list[str]:
        """The ways a forward of a few rows can run here, torch's last."""
        return [TORCH]

    @contextlib.contextmanager
    def forced(self, way: str):
        """Forwards of any number of rows run `way` (one of `ways()`) inside the context, as before after it."""
        if way not in self.ways():
            raise ValueError(f"a forward cannot run as {way!r} here; choose from {', '.join(self.ways())}")
        yield

    def use(self, rows: int, tiles: bool) -> None:
        """What calibration measured: the C++ forward up to `rows` rows, its products on the tiles with `tiles`."""

    def key(self) -> str:
        """What a measured forward time depends on in this runtime besides the model's own code (the C++ forward's
        source, build and use), for the caches of measurements."""
        return ""

    def loops(self) -> str:
        """Where a step's loops run, as reports say it."""
        return self.kernels.name


class NativeRuntime(Runtime):
    """A CPU with the C++ loops: a step's loops in C++, a commit's moves in C++, and, where the instruction set, dtype
    and width allow, a forward of up to `rows` rows as one C++ call (native.Blocks)."""

    name = "C++"

    def __init__(self, device: torch.device, dtype: torch.dtype, quantization: Format | None = None,
                 cpp_forward: bool = True, compile_layers: bool = False):
        super().__init__(device, dtype, quantization, compile_layers)
        self.kernels = NativeKernels()
        self.cpp_forward = cpp_forward

    @property
    def tiles(self) -> bool:
        return self.blocks is not None and self.blocks.tiles

    def loads_forward(self, n_embd: int) -> bool:
        return self.cpp_forward and native.Blocks.fit(n_embd, self.dtype, self.device, self.quantization is not None)

    def load_forward(self, shape, tensors, output, consume) -> None:
        self.blocks = native.Blocks(shape, tensors, output, self.dtype, consume=consume)
        self.rows = native.Blocks.ROWS

    def mover(self, cache: torch.Tensor) -> Mover:
        return native.SlotMover(cache)

    def ways(self) -> list[str]:
        if self.blocks is None:
            return [TORCH]
        return [CPP, *([CPP_TILES] if self.blocks.can_tile else []), TORCH]

    @contextlib.contextmanager
    def forced(self, way: str):
        with super().forced(way):
            before = self.rows, self.tiles
            if way != TORCH and self.blocks is not None:  # (a way but torch's is one only with a C++ forward)
                self.blocks.tiles = way == CPP_TILES
            self.rows = 0 if way == TORCH else native.Blocks.ROWS
            try:
                yield
            finally:
                self.use(*before)

    def use(self, rows: int, tiles: bool) -> None:
        self.rows = rows if self.blocks is not None else 0
        if self.blocks is not None:
            self.blocks.tiles = tiles

    @property
    def chunks(self) -> bool:
        """Whether a forward of more rows than one C++ call takes runs as several (the C++ call was never measured
        slower than torch's forward, which calibration would have shown by lowering `rows`)."""
        return self.rows == native.Blocks.ROWS

    def key(self) -> str:
        if self.blocks is None:
            return ""
        return ("".join(source.read_text() for source in native.FORWARD_SOURCES) + (native.forward_build(self.dtype) or "")
                + f"{self.rows} {self.tiles}" + (f" {self.quantization.name}" if self.quantization else ""))


class CudaRuntime(Runtime):
    """A GPU: torch's forward (replayed as CUDA graphs where asked), its attention without cuDNN's; the portable loops
    over the logits, which stay on the GPU; the C++ loops for the host's data where built."""

    name = "CUDA"

    def __init__(self, device: torch.device, dtype: torch.dtype, quantization: Format | None = None,
                 cuda_graphs: bool = False, compile_layers: bool = False):
        super().__init__(device, dtype, quantization, compile_layers)
        self.cuda_graphs = cuda_graphs
        if quantization is not None:
            native.note_once(f"a {quantization.name} model runs on a GPU dequantized to {str(dtype).removeprefix('torch.')}: "
                             f"the same model, its weights read at 16 or 32 bits each (the quantized products are the CPU's)")

    def layout(self, in_features, out_features, gelu, calibrate) -> str:
        return default_layout(self.dtype)

    def pads_rows(self) -> bool:
        return False

    def attention(self):
        return sdpa_kernel(ATTENTION_WITHOUT_CUDNN)

    def graphs(self, engine) -> CUDAGraphs | None:
        return CUDAGraphs(engine) if self.cuda_graphs else None

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def loops(self) -> str:
        return f"{host_kernels().name} for the trees, Python for the GPU's logits"


def runtime_for(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, cpp_forward: bool = True,
                cuda_graphs: bool = False, quantization: Format | None = None, compile_layers: bool = False) -> Runtime:
    """The runtime of a model on `device` computing in `dtype`, its matrices in `quantization`'s blocks where given:
    on a CPU the C++ one where it is built (its forward of a few rows only with `cpp_forward`), on a GPU the CUDA one
    (replaying CUDA graphs with `cuda_graphs`); torch's forward computes its layers through torch.compile with
    `compile_layers`."""
    device = torch.device(device)
    if device.type == "cuda":
        return CudaRuntime(device, dtype, quantization, cuda_graphs, compile_layers)
    if device.type == "cpu" and native.module() is not None:
        return NativeRuntime(device, dtype, quantization, cpp_forward, compile_layers)
    return Runtime(device, dtype, quantization, compile_layers)
