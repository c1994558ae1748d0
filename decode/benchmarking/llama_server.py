"""llama.cpp as peers of the bench through its server binary (`llama-server`, found on PATH or named by LLAMA_SERVER),
on the oracle (and the draft) exported to GGUF in the run's dtype, on as many threads as ours: `llamacpp-server` (its
plain decoding), `llamacpp-draft` (its draft-model speculation, `--spec-type draft-simple`, at the
`--spec-draft-n-max` that ran fastest on the first prompts) and `llamacpp-ngram` (the fastest of its n-gram
drafters). Prompts go in and tokens come out as token ids, so outputs compare token for token; a healed prompt's first
token is decoded alone, limited to the tokens that extend its tail, and the rest continues from the cached prompt.
Each server's peak resident memory is read when it stops."""
import functools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from decode.errors import InputError
from decode.healing import Prompt
from decode.loop import Generation
from decode.provenance import llama_server_settings
from decode.sampling import Sampling

SERVER_PEERS = ("llamacpp-server", "llamacpp-draft", "llamacpp-ngram")
SERVER_VARIABLE = "LLAMA_SERVER"
BUILD = ("cmake -B build -DLLAMA_CURL=OFF && cmake --build build --target llama-server -j in the llama.cpp source "
         "(the llama-cpp-python sdist carries it in vendor/llama.cpp; docs/installation.md), then put build/bin on PATH "
         f"or set {SERVER_VARIABLE} to build/bin/llama-server")
# The settings each peer tries on the first prompts, keeping the fastest: llama-server's own flags
CANDIDATES: dict[str, list[list[str]]] = {
    "llamacpp-server": [[]],
    "llamacpp-draft": [["--spec-type", "draft-simple", "--spec-draft-n-max", str(n)] for n in (2, 4, 8, 16)],
    "llamacpp-ngram": [["--spec-type", kind] for kind in ("ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod")],
}
TUNING_PROMPTS = 3
STARTUP_SECONDS = 120


def server_binary() -> str | None:
    """The llama-server to run: LLAMA_SERVER's, else the one on PATH, else None."""
    named = os.environ.get(SERVER_VARIABLE)
    if named:
        return named if os.access(named, os.X_OK) else None
    return shutil.which("llama-server")


def missing_reason() -> str:
    named = os.environ.get(SERVER_VARIABLE)
    where = f"{SERVER_VARIABLE}={named} is not an executable" if named else f"no llama-server on PATH and {SERVER_VARIABLE} unset"
    return f"{where}; build it: {BUILD}"


def server_version(binary: str) -> str:
    """What `llama-server --version` says of itself, in a line."""
    try:
        done = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"unreadable ({err})"
    line = next((line for line in (done.stdout + done.stderr).splitlines() if line.startswith("version")), "")
    return line.removeprefix("version:").strip() or "no version printed"


def server_build(binary: str) -> str:
    """What a result records of llama.cpp's build: `llama-server --version`'s line, the widest instructions its CPU
    backend was built for (llama.cpp picks them when it is compiled, not when it runs), and the settings llama-server
    reads from this environment (decode.provenance.llama_server_settings)."""
    instructions = cpu_instructions(binary)
    settings = llama_server_settings()
    return (server_version(binary) + (f" for {', '.join(instructions)}" if instructions else "")
            + (f" with {' '.join(settings)}" if settings else ""))


def cpu_instructions(binary: str) -> list[str]:
    """The widest instructions (AMX, AVX-512's, else AVX2) llama.cpp's CPU backend (the libggml-cpu that the binary
    loads) was built for, as its log names them at `-lv 4`: it prints them before reading a model, so a model file
    that does not exist ends the probe at once. Empty where the log names none."""
    with tempfile.TemporaryDirectory() as folder:
        try:
            done = subprocess.run([binary, "-m", str(Path(folder) / "none.gguf"), "-lv", "4", "--port", "0"],
                                  capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            return []
    return built_for(done.stdout + done.stderr)


def built_for(log: str) -> list[str]:
    """The widest instructions in a llama.cpp log's "CPU : AVX = 1 | AVX2 = 1 | ..." line."""
    line = next((line for line in log.splitlines() if "CPU :" in line), "")
    named = [part.split("=")[0].strip() for part in line.split("CPU :", 1)[-1].split("|") if part.strip().endswith("= 1")]
    widest = [name for name in named if name.startswith(("AVX512", "AMX"))]
    return widest or [name for name in named if name == "AVX2"]


@functools.cache
def check_server(binary: str, name: str) -> None:
    """Refuse, in one line naming the version found and what is needed, a llama-server whose flags lack what the
    peer `name` passes it (CANDIDATES[name]): an older build than the peers were written against."""
    wanted = {word for flags in CANDIDATES[name] for word in flags if not word.isdigit()}
    if not wanted:
        return
    try:
        usage = subprocess.run([binary, "--help"], capture_output=True, text=True, timeout=60)
        text = usage.stdout + usage.stderr
    except (OSError, subprocess.TimeoutExpired):
        text = ""
    missing = sorted(word for word in wanted if word not in text)
    if missing:
        raise InputError(f"{binary} (version {server_version(binary)}) lacks {', '.join(missing)}, which {name} needs: "
                         f"a llama-server as new as the llama.cpp that llama-cpp-python 0.3.36 vendors, or newer; {BUILD}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer:
    """One llama-server process over the exported oracle (and the draft), with llama.cpp's flags `flags`, decoding up
    to `slots` requests at once (its continuous batching), each with a context of `context` tokens."""

    def __init__(self, models: dict[str, Path], flags: list[str], threads: int, context: int, slots: int = 1):
        self.port = free_port()
        self.log = tempfile.TemporaryFile()
        command = [server_binary() or "llama-server", "-m", str(models["oracle"]), "--host", "127.0.0.1",
                   "--port", str(self.port), "-t", str(threads), "-tb", str(threads), "-c", str(context * slots),
                   "-np", str(slots),
                   "-ngl", "0", *(["-md", str(models["draft"]), "-ngld", "0"] if "draft" in models else []), *flags]
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + STARTUP_SECONDS
        while not self.healthy():
            if self.process.poll() is not None or time.monotonic() > deadline:
                said, killed = self.log_tail(), self.process.poll() is not None and self.process.returncode < 0
                self.close()
                binary = server_binary() or "llama-server"
                why = f"it died of {signal.Signals(-self.process.returncode).name}; " if killed else ""
                hint = ("; where its weights are quantized, llama.cpp's AMX or repacked kernels may be what crashed: "
                        "LLAMA_ARG_REPACK=0 in the environment turns them off, or its CPU backend built without AMX keeps "
                        "the repacked ones (docs/benchmarks.md)") if killed else ""
                raise InputError(f"llama-server {' '.join(flags)} (version {server_version(binary)}) did not start "
                                 f"({why}its log ends: {said}){hint}")
            time.sleep(0.2)

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5) as reply:
                return reply.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False

    def log_tail(self) -> str:
        self.log.seek(0)
        lines = self.log.read().decode(errors="replace").strip().splitlines()
        return " / ".join(lines[-3:]) or "no output"

    def complete(self, request: dict) -> dict:
        """llama-server's /completion for `request` (token ids in, token ids out)."""
        body = json.dumps({"return_tokens": True, "stream": False, **request}).encode()
        post = urllib.request.Request(f"http://127.0.0.1:{self.port}/completion", body, {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(post, timeout=600) as reply:
                return json.loads(reply.read())
        except (urllib.error.URLError, ConnectionError, TimeoutError) as err:
            raise InputError(f"llama-server failed a completion ({err}): {self.log_tail()}") from None

    def stream(self, request: dict) -> tuple[int, float]:
        """llama-server's /completion for `request`, streamed: the tokens it made, and the seconds until the first."""
        body = json.dumps({"return_tokens": True, "stream": True, **request}).encode()
        post = urllib.request.Request(f"http://127.0.0.1:{self.port}/completion", body, {"Content-Type": "application/json"})
        start, first, tokens = time.perf_counter(), None, 0
        try:
            with urllib.request.urlopen(post, timeout=600) as reply:
                for line in reply:
                    if line.startswith(b"data: "):
                        made = len(json.loads(line[6:]).get("tokens", []))
                        if made and first is None:
                            first = time.perf_counter() - start
                        tokens += made
        except (urllib.error.URLError, ConnectionError, TimeoutError) as err:
            raise InputError(f"llama-server failed a completion ({err}): {self.log_tail()}") from None
        return tokens, time.perf_counter() - start if first is None else first

    def peak_rss_mb(self) -> float | None:
        """The server's peak resident memory so far (Linux's VmHWM), in MiB; None where it cannot be read."""
        try:
            status = Path(f"/proc/{self.process.pid}/status").read_text()
        except OSError:
            return None
        return next((int(line.split()[1]) / 1024 for line in status.splitlines() if line.startswith("VmHWM:")), None)

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()


def sampler(sampling: Sampling, temperature: str = "temperature") -> dict:
    """llama.cpp's sampling settings for ours, its defaults (min-p 0.05, top-p 0.95, repetition penalties) off; the
    temperature under llama-server's name, or `temperature` (llama-cpp-python's "temp")."""
    neutral = {"top_k": 0, "top_p": 1.0, "min_p": 0.0, "typical_p": 1.0, "repeat_penalty": 1.0, temperature: 0.0}
    if sampling.greedy:
        return neutral
    return neutral | {temperature: sampling.temperature, "top_k": sampling.top_k or 0, "top_p": sampling.top_p}


def export_gguf(oracle_dir, draft_dir, folder: Path, dtype: str, draft_dtype: str | None = None) -> dict[str, Path]:
    """The oracle (and the draft, in `draft_dtype` where given: a dtype or the block format ours was quantized to as
    it loaded) as GGUF files in `folder`, written by decode.export in a process of its own, so that the export's
    reading of the weights does not count in the bench's own peak memory; by name."""
    command = [sys.executable, "-m", "decode.export", "--oracle", str(oracle_dir), "--out", str(folder), "--dtype", dtype]
    command += ["--draft", str(draft_dir)] if draft_dir is not None else []
    command += ["--draft-dtype", draft_dtype] if draft_dir is not None and draft_dtype is not None else []
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        reason = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise InputError(f"the GGUF export for llama.cpp failed: {reason}")
    return {name: folder / f"{name}.gguf" for name in ("oracle", "draft") if name == "oracle" or draft_dir is not None}


class ServerPeer:
    """A peer: llama.cpp's decoding through llama-server at the fastest of `CANDIDATES[name]` on the first prompts."""

    def __init__(self, name: str, oracle_dir, draft_dir, sampling: Sampling, eos_id: int, dtype: str, threads: int,
                 context: int, draft_dtype: str | None = None):
        self.server: LlamaServer | None = None
        check_server(server_binary() or "llama-server", name)
        self.folder = tempfile.TemporaryDirectory(prefix="llamacpp-gguf-")  # removed with this object
        self.models = export_gguf(oracle_dir, draft_dir if name == "llamacpp-draft" else None, Path(self.folder.name),
                                  dtype, draft_dtype)
        self.name, self.sampling, self.eos_id, self.threads, self.context = name, sampling, eos_id, threads, context
        self.flags = CANDIDATES[name][0]
        self.peak_rss: float | None = None

    def choose(self, prompts: list[Prompt], max_new_tokens: int) -> str | None:
        """Runs each candidate setting on `prompts` and keeps the fastest; what was measured, in a line (None: one
        setting, nothing to choose)."""
        if len(CANDIDATES[self.name]) == 1:
            return None
        timed = []
        for flags in CANDIDATES[self.name]:
            self.start(flags)
            self(prompts[0], max_new_tokens, 0)  # warm-up
            start = time.perf_counter()
            tokens = sum(len(self(prompt, max_new_tokens, i).tokens) for i, prompt in enumerate(prompts))
            timed.append((tokens / (time.perf_counter() - start), flags))
        best = max(timed, key=lambda t: t[0])[1]
        self.start(best)
        shown = ", ".join(f"{' '.join(flags[1:])}: {speed:.0f} tok/s" for speed, flags in timed)
        return f"{self.name}: {' '.join(best)} (fastest on {len(prompts)} prompts; {shown})"

    def start(self, flags: list[str]) -> "LlamaServer":
        self.close()
        self.server, self.flags = LlamaServer(self.models, flags, self.threads, self.context), flags
        return self.server

    def running(self) -> "LlamaServer":
        """The server, started with the chosen flags if it is not running."""
        return self.server if self.server is not None else self.start(self.flags)

    def __call__(self, prompt: Prompt, max_new_tokens: int, seed: int) -> Generation:
        server = self.running()
        ids, generation = prompt.ids.tolist(), Generation()
        request = {"prompt": ids, "n_predict": max_new_tokens, "seed": seed, "cache_prompt": False, **sampler(self.sampling)}
        if prompt.allowed is not None:  # the healed first token alone, then the rest after the cached prompt
            banned = (~prompt.allowed).nonzero().flatten().tolist()
            first = server.complete({**request, "n_predict": 1, "logit_bias": [[t, False] for t in banned]})
            if generation.add(first["tokens"] or [self.eos_id], max_new_tokens, (self.eos_id,)):
                generation.oracle_calls = 1
                return generation
            request = {**request, "prompt": ids + generation.tokens, "n_predict": max_new_tokens - 1,
                       "seed": seed + 1, "cache_prompt": True}
            generation.oracle_calls = 1
        reply = server.complete(request)
        tokens = reply["tokens"] + ([self.eos_id] if reply.get("stop_type") == "eos" else [])
        generation.add(tokens, max_new_tokens, (self.eos_id,))
        timings = reply.get("timings", {})
        accepted = timings.get("draft_n_accepted", 0)
        generation.oracle_calls += max(1, timings.get("predicted_n", len(reply["tokens"])) - accepted)
        return generation

    def gaps(self, context: list[int], a: int, b: int, prompt_length: int) -> list[float]:
        """logit[a] - logit[b] after `context` as llama.cpp computes it (the context in one forward), where both are
        among its 20 best tokens there (their log-probabilities' difference); none otherwise, or where llama-server
        gives no probabilities (its best token ends inside a UTF-8 character)."""
        reply = self.running().complete({"prompt": context, "n_predict": 1, "n_probs": 20, "cache_prompt": False,
                                      **sampler(Sampling())})
        if not reply.get("completion_probabilities"):  # a token that ends inside a UTF-8 character: held back, unread
            return []
        best = {entry["id"]: entry["logprob"] for entry in reply["completion_probabilities"][0]["top_logprobs"]}
        return [best[a] - best[b]] if a in best and b in best else []

    def close(self) -> None:
        if self.server is not None:
            self.peak_rss = max(self.peak_rss or 0.0, self.server.peak_rss_mb() or 0.0) or None
            self.server.close()
            self.server = None

    def __del__(self):
        self.close()
