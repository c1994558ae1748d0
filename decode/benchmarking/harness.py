"""What the tools that time or check decoding share (decode.bench, decode.plan, decode.profile_step,
decode.agreement): one way to time the parts of a step, the methods taking turns on each prompt, and the comparison
of each method's greedy output with the baseline's."""
import time
from collections import defaultdict
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

from tqdm import tqdm

from decode import loop
from decode.healing import Prompt

# (prompt, its index, how many tokens) -> the Generation of one decoding of it
Run = Callable[[Prompt, int, int], loop.Generation]
WARMUP_TOKENS = 16


class Timer:
    """Seconds and calls per label. `hooks` are the decoding loop's: they report the oracle's forwards, the
    proposals and the verifications here; `wrap` times a method of an object the loop calls into (a draft model's
    forward, the trigram's tree builder). Each timing waits for the device work queued before it and for its own
    (`synchronize`: the oracle's runtime's, on a GPU): else a forward's time lands in whatever next reads its result."""

    def __init__(self, synchronize: Callable[[], None] = lambda: None):
        self.synchronize = synchronize
        self.seconds: defaultdict[str, float] = defaultdict(float)
        self.calls: defaultdict[str, int] = defaultdict(int)
        self.forwards: list[tuple[int, int, float]] = []  # the oracle's forwards as (new nodes, slots cached before, seconds), with `hooks(log=True)`

    def add(self, label: str, seconds: float) -> None:
        self.seconds[label] += seconds
        self.calls[label] += 1

    def hooks(self, label: str = "") -> loop.Hooks:
        """The loop's hooks, adding to "oracle prompt" (a forward at an empty cache) and "oracle forward",
        "propose" and "verification", each label prefixed by `label`; each forward is also logged in `forwards`."""

        def on_forward(nodes: int, cached: int, seconds: float) -> None:
            self.add(f"{label}oracle {'forward' if cached else 'prompt'}", seconds)
            self.forwards.append((nodes, cached, seconds))

        return loop.Hooks(on_forward, lambda s: self.add(f"{label}propose", s), lambda s: self.add(f"{label}verification", s),
                          self.synchronize)

    def wrap(self, owner, name: str, label: str | Callable[[], str]) -> None:
        """Time owner.name (an object's method) from now on; a callable `label` is asked before each call which label
        the call's time goes to."""
        inner = getattr(owner, name)

        def timed(*args, **kwargs):
            counted = label if isinstance(label, str) else label()
            self.synchronize()
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.synchronize()
                self.add(counted, time.perf_counter() - start)

        setattr(owner, name, timed)

    def clear(self) -> None:
        self.seconds.clear()
        self.calls.clear()
        self.forwards.clear()

    @contextmanager
    def paused(self):
        """What runs inside is not counted."""
        seconds, calls, forwards = dict(self.seconds), dict(self.calls), len(self.forwards)
        yield
        self.seconds, self.calls = defaultdict(float, seconds), defaultdict(int, calls)
        del self.forwards[forwards:]


def in_turns(names: list[str], i: int) -> list[str]:
    """The order the methods decode prompt i in: rotated by one each prompt, so that none always runs right after
    another (each slows the next one's first forwards by evicting its weights from the caches)."""
    return names[i % len(names):] + names[: i % len(names)]


def warm_up(runs: dict[str, Run], prompt: Prompt, max_new_tokens: int) -> None:
    """Every method decodes a few tokens of `prompt`, before any timing: a process's first forwards of each shape
    allocate, build kernels and fill caches."""
    for run in runs.values():
        run(prompt, 0, min(WARMUP_TOKENS, max_new_tokens))


def decode_in_turns(runs: dict[str, Run], prompts: list[Prompt], max_new_tokens: int,
                    progress: str | None = None) -> dict[str, list[dict]]:
    """Every method on every prompt for `max_new_tokens`, in turns (`in_turns`); per method a record per prompt: the
    tokens, the seconds, the oracle's calls and the nodes it scored. `progress`: a progress bar over the prompts, so
    described."""
    records: dict[str, list[dict]] = {name: [] for name in runs}
    for i, prompt in enumerate(tqdm(prompts, desc=progress, unit="prompt", disable=progress is None)):
        for name in in_turns(list(runs), i):
            start = time.perf_counter()
            out = runs[name](prompt, i, max_new_tokens)
            seconds = time.perf_counter() - start
            records[name].append({"tokens": out.tokens, "seconds": seconds, "oracle_calls": out.oracle_calls,
                                  "oracle_nodes": out.oracle_nodes})
    return records


# (method, prompt index, the prompt, the baseline's tokens, the method's) -> None when they are the same, else where
# and why they differ (decode.benchmarking.near_ties.divergence)
Judge = Callable[[str, int, Prompt, list[int], list[int]], dict | None]


def compare_with_baseline(outputs: dict[str, list[list[int]]], prompts: list[Prompt], task_ids: list[str],
                          judge: Judge) -> dict[str, dict]:
    """Per method, its greedy outputs against the baseline's: how many are identical, the near-ties (a numerical
    tie in the oracle's logits settled the other way) and the differences (a near-tie could not explain them)."""
    checks = {}
    for name, rows in outputs.items():
        check: dict[str, Any] = {"identical": 0, "near_ties": [], "differences": []}
        for i, (prompt, got, expected) in enumerate(zip(prompts, rows, outputs["baseline"])):
            diff = judge(name, i, prompt, expected, got)
            if diff is None:
                check["identical"] += 1
            else:
                check["near_ties" if diff["near_tie"] else "differences"].append({"task_id": task_ids[i], **diff})
        checks[name] = check
    return checks
