"""What a result was measured with: this code's git commit (marked dirty where tracked files differ from it) and the
versions of the libraries that do the work. Written into every result file; `decode.report` prints it."""
import functools
import importlib.metadata
import os
import shlex
import subprocess
import sys
from pathlib import Path

from decode.machine import AS_CPU, taken_as_avx2

ROOT = Path(__file__).resolve().parent.parent
COMMIT = "STAGED_SPECULATIVE_COMMIT"  # names the commit of a copy of the code whose own git history cannot: none, or
# an older one than the files it holds


@functools.cache
def code_commit() -> str:
    """The checkout's commit, "-dirty" after it where a tracked file outside docs/ differs from it (the results and
    pages a measurement writes there do not change what it measures); "unknown" outside a git checkout (an installed
    wheel). STAGED_SPECULATIVE_COMMIT, where set, says it instead, for a copy of a commit's files."""
    if named := os.environ.get(COMMIT):
        return named
    try:
        commit = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                timeout=30, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)docs"],
                               cwd=ROOT, capture_output=True, text=True, timeout=30, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return commit + ("-dirty" if dirty else "")


def llama_server_settings() -> list[str]:
    """The settings llama-server reads from this environment (its LLAMA_ARG_* variables, e.g. LLAMA_ARG_REPACK=0 for
    --no-repack), as NAME=value, quoted for a shell."""
    return sorted(f"{name}={shlex.quote(value)}" for name, value in os.environ.items() if name.startswith("LLAMA_ARG_"))


def command_line(prog: str, argv: list[str] | None) -> str:
    """The command a result was made by, as a user types it: `prog` and its arguments (`argv`, else the process's),
    after the environment settings that change what it measures (STAGED_SPECULATIVE_CPU=avx2; llama-server's
    LLAMA_ARG_* variables, which the llama.cpp peers' servers read)."""
    settings = [f"{AS_CPU}=avx2"] if taken_as_avx2() else []
    settings += llama_server_settings()
    return " ".join([*settings, prog, shlex.join(sys.argv[1:] if argv is None else list(argv))])


def provenance() -> dict[str, str]:
    """The commit and the versions of torch and transformers, for a result's settings."""
    return {"commit": code_commit(), "torch": importlib.metadata.version("torch"),
            "transformers": importlib.metadata.version("transformers")}


def built_with(settings: dict) -> str:
    """What a result was measured with (decode.provenance; llama.cpp's builds for its peers), as a clause, which says
    so of a result written before they were recorded."""
    if "commit" not in settings:
        return ", code not recorded"
    versions = [f"{name.replace('_', '-')} {settings[name]}" for name in ("torch", "transformers", "llama_server",
                                                                          "llama_cpp_python") if name in settings]
    return f", code {settings['commit']} ({', '.join(versions)})"
