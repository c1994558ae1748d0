"""What decoding does differently by the kind of device it is asked for, decided before any model is loaded: the
device checked, its name in measurements, and each kind's defaults (`DeviceKind`). How a loaded model then runs there
(kernels, the C++ forward, CUDA graphs) is its runtime's (decode.models.runtime)."""
from dataclasses import dataclass

import torch

from decode.errors import InputError, first_line
from decode.machine import AVX2_ALONE, cpu_features, cpu_name, taken_as_avx2


@dataclass(frozen=True)
class DeviceKind:
    budget: int  # without a plan: the oracle's tree nodes
    widths: tuple[int, ...]  # without a plan: the trigram's widths below the draft
    chain: tuple[int, int] | None  # without a plan: staged drafts the draft's own chain of this many tokens (greedy,
    # sampling) unless the caller sizes the tree; None: the tree above
    sampled_method: str | None  # without a plan, staged by default when sampling gives way to this method
    graphs: bool  # forwards may replay CUDA graphs
    measured_dtype: bool  # "auto" stands for the dtype the oracle was timed faster in (else: what the device has)
    draft_precisions: tuple[str, ...]  # what the planner weighs a draft in beside the oracle's dtype: a draft's forwards
    # of a few rows are mostly per-call overhead, which on a CPU differs by dtype (MKL's float32 products against
    # oneDNN's bfloat16 ones) and by block format (the C++ products over Q8_0 or Q4_0 blocks read a half or a quarter
    # of the bytes)


# On a CPU the trigram widths and budget plans chose there for the cpu preset; the paper's tree has the draft score up
# to 1,441 nodes a step, slower than plain decoding there (docs/decoding.md). Staged drafts the draft's own chain, with
# no stage below the draft: the shape decode.plan chose for the presets (docs/planning.md), of 7 tokens when greedy,
# and when sampling of the speculative method's 4 (acceptance falls with depth when sampling). Whether a tree or the
# trigram's stage pays on a CPU depends on its forward of many rows, which the planner measures.
CPU_CHAIN = (7, 4)
CPU = DeviceKind(budget=12, widths=(3, 2, 1), chain=CPU_CHAIN, sampled_method=None, graphs=False, measured_dtype=True,
                 draft_precisions=("float32", "q8_0", "q4_0"))
# On a GPU the trigram widths and budget decode.plan chose for the quick preset on an NVIDIA H200 (docs/gpu.md); the
# paper's tree is larger than what pays there for models of that size. Sampling without a plan, every drafted tree
# measured there ran slower than plain decoding, and lookup, which drafts without a model's forward, at its speed
# give or take a few percent either way: plain decoding is the default that never loses.
GPU = DeviceKind(budget=16, widths=(4, 2, 1), chain=None, sampled_method="baseline", graphs=True, measured_dtype=False,
                 draft_precisions=())


def kind(device: str | torch.device) -> DeviceKind:
    return CPU if torch.device(device).type == "cpu" else GPU


def check_device(device: str) -> None:
    """cpu, or cuda[:N] on a machine that has it."""
    try:
        parsed = torch.device(device)
    except RuntimeError:
        parsed = None
    if parsed is None or parsed.type not in ("cpu", "cuda"):
        raise InputError(f"unknown --device {device!r}; use cpu or cuda (cuda:N for the N-th GPU)")
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            raise InputError(f"--device {device}: this machine has no CUDA device (or torch was built without CUDA); use --device cpu")
        if parsed.index is not None and parsed.index >= torch.cuda.device_count():
            raise InputError(f"--device {device}: there are only {torch.cuda.device_count()} CUDA devices")


def native_bfloat16(device: str | torch.device) -> tuple[bool, str]:
    """Whether the device multiplies in bfloat16 natively, and why, in words."""
    if torch.device(device).type == "cuda":
        supported = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
        return supported, "this GPU supports it" if supported else "this GPU lacks bfloat16"
    features = cpu_features()
    if "BF16" in features or "AMX" in features:
        return True, f"this CPU multiplies in it natively ({features})"
    return False, f"this CPU has no bfloat16 instructions ({features or 'no AVX2'})"


def device_name(device: torch.device) -> str:
    """What a measured time depends on besides the model: the GPU's name, or the CPU's and its threads."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    alone = f" ({AVX2_ALONE})" if taken_as_avx2() else ""  # what measured it, for the caches named by it
    return f"{cpu_name()}{alone}, {torch.get_num_threads()} threads"


def machine_name(device: torch.device) -> str:
    """`device_name` with, on a CPU, the instructions that decide its bfloat16 speed: what a benchmark ran on."""
    if device.type == "cuda":
        return device_name(device)
    features = cpu_features(actual=True) + (f", {AVX2_ALONE}" if taken_as_avx2() else "")
    return f"{cpu_name()}" + (f" ({features})" if features else "") + f", {torch.get_num_threads()} threads"


def check_compiler(device: str, flags: list[str], instead: str) -> None:
    """torch.compile builds its kernels as a compiled function first runs: C++ on a CPU, Triton's on a GPU. Where it
    cannot, say so now in one line naming `flags` (what asked for it) and `instead` (how to do without), rather than
    fail at the first forward with torch's traceback."""
    if not flags:
        return
    need = "needs" if len(flags) == 1 else "need"
    if torch.device(device).type == "cuda":
        from torch.utils._triton import has_triton

        if not has_triton():
            raise InputError(f"{' and '.join(flags)} {need} Triton on a GPU (pip install triton); or {instead}")
        return
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler
        from torch._inductor.exc import InvalidCxxCompiler
    except ImportError:
        return  # a torch without this check: its compile reports for itself
    try:
        get_cpp_compiler()
    except InvalidCxxCompiler as err:
        raise InputError(f"{' and '.join(flags)} {need} a C++ compiler on a CPU ({first_line(err)}); install one "
                         f"(g++), or {instead}") from None
