"""What a measured time depends on besides the model: which CPU it ran on, as the operating system names it."""
import platform
from pathlib import Path


def cpu_name() -> str:
    """The processor's model name (the kind of CPU changes between machines of the same name)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_flags() -> set[str]:
    """The CPU's instruction set flags as /proc/cpuinfo names them (empty where it cannot be read)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return set(next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), []))


def cpu_features() -> str:
    """The instructions that decide a CPU's bfloat16 speed, as a reader of a benchmark names them."""
    flags = cpu_flags()
    named = [name for flag, name in (("amx_bf16", "AMX"), ("avx512_bf16", "AVX-512 BF16")) if flag in flags]
    return ", ".join(named) or ("AVX2" if "avx2" in flags else "")
