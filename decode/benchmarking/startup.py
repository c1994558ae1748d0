"""How long a decoding command takes from its process's start: to its models loaded (the prompt echoed), to its
first new token and to its exit, and its peak resident memory, over fresh processes; beside a process that imports
torch alone, the floor every command stands on."""
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

FLOOR = ["-c", "import torch"]
# Linux counts a process's memory before its exec in its peak, so a process forked from this one (which holds torch)
# would report at least this one's: each is started by a small Python that writes its child's peak to a file
LAUNCHER = ("import os, subprocess, sys; child = subprocess.Popen(sys.argv[2:]); _, status, usage = os.wait4(child.pid, 0); "
            "open(sys.argv[1], 'w').write(f'{usage.ru_maxrss} {os.waitstatus_to_exitcode(status)}')")


@dataclass
class Start:
    """One fresh process: seconds from its start to the prompt's echo and to the first byte after it (None where it
    prints neither: the floor), to its exit, and its peak resident memory in MiB."""

    loaded: float | None
    first_token: float | None
    exit: float
    peak_rss_mb: float


def timed_process(args: list[str], echo: bytes = b"") -> Start:
    """Run `python ARGS` once (through LAUNCHER, whose own start, a few tens of milliseconds, the times include),
    reading its standard output as it comes: `echo`, the text it prints before decoding (decode.run --stream's
    prompt), then the first byte of the completion."""
    with tempfile.TemporaryFile() as errors, tempfile.TemporaryDirectory() as folder:
        peak = Path(folder) / "peak"
        start = time.perf_counter()
        child = subprocess.Popen([sys.executable, "-I", "-S", "-c", LAUNCHER, str(peak), sys.executable, *args],
                                 stdout=subprocess.PIPE, stderr=errors)
        out, loaded, first = child.stdout, None, None
        assert out is not None
        if echo and out.read(len(echo)) == echo:
            loaded = time.perf_counter() - start
            first = time.perf_counter() - start if out.read(1) else None
        out.read()
        child.wait()
        ended = time.perf_counter() - start
        kib, code = map(int, peak.read_text().split()) if peak.exists() else (0, child.returncode)
        if code != 0 or (echo and first is None):
            errors.seek(0)
            said = (errors.read().decode(errors="replace").strip().splitlines() or ["(nothing on stderr)"])[-1]
            raise RuntimeError(f"python {' '.join(args)} exited {code}: {said.removeprefix('error: ')[-300:]}")
    return Start(loaded, first, ended, kib / 1024)


def medians(starts: list[Start]) -> dict:
    """Each figure's median over the processes (None where none has it)."""
    return {key: statistics.median(values) if (values := [v for s in starts if (v := getattr(s, key)) is not None])
            else None for key in asdict(starts[0])}


def profile_start(command: list[str], echo: str, repeats: int, progress=lambda done: None) -> dict:
    """`repeats` fresh processes of `python COMMAND` and of the floor, taken in turns (a shared machine's speed
    drifts), each process's figures and their medians."""
    runs: dict[str, list[Start]] = {"floor": [], "command": []}
    for i in range(repeats):
        runs["floor"].append(timed_process(FLOOR))
        runs["command"].append(timed_process(command, echo.encode()))
        progress(i + 1)
    return {name: {"median": medians(starts), "runs": [asdict(s) for s in starts]} for name, starts in runs.items()}
