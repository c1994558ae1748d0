"""What a measured time depends on besides the model: which CPU it ran on, as the operating system names it.

STAGED_SPECULATIVE_CPU=avx2 takes this CPU for one with AVX2 alone: the C++ forward built for AVX2 runs, torch's own
kernels and torch.compile's take their AVX2 code (decode/__init__.py sets ATEN_CPU_CAPABILITY and ONEDNN_MAX_CPU_ISA
where torch is not loaded yet, and a cache of torch.compile's kernels apart), and the CPU's AVX-512 and AMX stay
unused, so that the code an AVX2 CPU runs can be measured on a newer one; results name the CPU "run with AVX2
alone"."""
import os
import platform
from pathlib import Path

from decode.errors import InputError

AS_CPU = "STAGED_SPECULATIVE_CPU"
AVX2_ALONE = "run with AVX2 alone"  # what results and caches call a CPU taken so
# The instruction sets a CPU taken for AVX2 alone lacks (as /proc/cpuinfo names them)
BEYOND_AVX2 = ("avx512", "amx", "avx_vnni")


def cpu_name() -> str:
    """The processor's model name (the kind of CPU changes between machines of the same name)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def taken_as_avx2() -> bool:
    """Whether STAGED_SPECULATIVE_CPU asks to take this CPU for one with AVX2 alone."""
    value = os.environ.get(AS_CPU, "")
    if value not in ("", "avx2"):
        raise InputError(f"{AS_CPU}={value!r} is not a CPU this toolkit can act as; set it to avx2 (a CPU with AVX2 "
                         f"alone) or unset it")
    return value == "avx2"


def cpu_flags(actual: bool = False) -> set[str]:
    """The CPU's instruction set flags as /proc/cpuinfo names them (empty where it cannot be read); those beyond AVX2
    left out where STAGED_SPECULATIVE_CPU=avx2, unless `actual`."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    flags = set(next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), []))
    if actual or not taken_as_avx2():
        return flags
    return {flag for flag in flags if not flag.startswith(BEYOND_AVX2)}


def cpu_features(actual: bool = False) -> str:
    """The instructions that decide a CPU's bfloat16 speed, as a reader of a benchmark names them (those it runs with,
    or with `actual` those it has)."""
    flags = cpu_flags(actual)
    named = [name for flag, name in (("amx_bf16", "AMX"), ("avx512_bf16", "AVX-512 BF16")) if flag in flags]
    return ", ".join(named) or ("AVX2" if "avx2" in flags else "")
