"""Timing the steps of many requests decoding at once (decode.batch) from outside: each step's oracle forward (every
request's piece of it as one call), the draft's forwards (every request's chain as one call), the rest of the
drafting (tree building) and the rest of the step (each request's loop: its verification, its tree's bookkeeping),
with the requests in flight. A step that reads a prompt (a piece of one in the oracle's forward, beside the others'
trees, or a draft's first chain, which reads it) is kept apart: it costs what the prompt's length makes it."""
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import decode.batch as batch_module
from decode.batch import Batch

PARTS = ("oracle forward", "draft forwards", "tree building", "verification and loop")


@dataclass
class Step:
    requests: int  # in flight as it began
    prompt: bool = False  # whether it read a prompt, or a piece of one
    seconds: dict[str, float] = field(default_factory=dict)  # by what decode.batch called: run_together, ...

    def parts(self) -> dict[str, float]:
        """Its seconds by PARTS: the drafting less the draft's forwards inside it is tree building."""
        oracle, drafting = self.seconds.get("run_together", 0.0), self.seconds.get("propose_together", 0.0)
        draft = self.seconds.get("chain_together", 0.0)
        return dict(zip(PARTS, (oracle, draft, drafting - draft, self.seconds["step"] - oracle - drafting)))


def reads_prompt(name: str, calls: list) -> bool:
    """Whether a call of decode.batch's `name` reads a prompt: an oracle piece that appends more than one token (a
    prompt's, chunked; plain decoding appends one a step), or a draft chain over an empty cache."""
    if name == "run_together":
        return any(call.extend and len(call.token_ids) > 1 for _, call in calls)
    return name == "chain_together" and any(call.model.length == 0 for call in calls)


@contextmanager
def timed_steps(batch: Batch, synchronize: Callable[[], None] = lambda: None) -> Iterator[list[Step]]:
    """The steps `batch` runs while inside, each timed by what decode.batch calls in it (its module's functions
    wrapped meanwhile: both are as they were after). `synchronize` waits for the device's queued work."""
    steps: list[Step] = []
    originals = {name: getattr(batch_module, name) for name in ("run_together", "propose_together", "chain_together")}

    def timed(name: str, inner: Callable) -> Callable:
        def call(calls: list):
            if not calls:  # nothing to run (no request drafts a chain, say): no time of the part's
                return inner(calls)
            step = steps[-1]
            step.prompt = step.prompt or reads_prompt(name, calls)
            synchronize()
            start = time.perf_counter()
            try:
                return inner(calls)
            finally:
                synchronize()
                step.seconds[name] = step.seconds.get(name, 0.0) + time.perf_counter() - start
        return call

    def timed_step() -> None:
        steps.append(Step(len(batch)))
        start = time.perf_counter()
        try:
            Batch.step(batch)
        finally:
            steps[-1].seconds["step"] = time.perf_counter() - start

    try:
        for name, inner in originals.items():
            setattr(batch_module, name, timed(name, inner))
        batch.step = timed_step  # type: ignore[method-assign]
        yield steps
    finally:
        for name, inner in originals.items():
            setattr(batch_module, name, inner)
        del batch.step


def summary(steps: list[Step], tokens: int) -> dict:
    """A level's figures: its steps, requests in flight and tokens a step (every step), and the decoding steps'
    (those that read no prompt) ms by part; the prompt-reading steps' count and median ms."""
    decoding, reading = [s for s in steps if not s.prompt], [s for s in steps if s.prompt]
    parts = {part: 1e3 * sum(s.parts()[part] for s in decoding) / max(1, len(decoding)) for part in PARTS}
    return {"steps": len(steps), "requests_a_step": statistics.fmean(s.requests for s in steps),
            "tokens_a_step": tokens / len(steps), "decoding_steps": len(decoding), "ms_a_step": sum(parts.values()),
            "parts_ms": parts, "prompt_steps": len(reading),
            "prompt_step_ms": 1e3 * statistics.median(s.seconds["step"] for s in reading) if reading else 0.0}


def table(levels: dict) -> list[tuple[str, list[str]]]:
    """Levels' summaries (by number of requests at once, as ints or as JSON keeps them) as the rows of a table with a
    column a level: (label, each level's value as shown), the ms of a step that reads no prompt followed by its parts'."""
    ordered = sorted(levels.items(), key=lambda item: int(item[0]))
    figures = [f for _, f in ordered]

    def shown(key: str, form: str = "") -> list[str]:
        return [format(f[key], form) for f in figures]

    return [("requests at once", [str(n) for n, _ in ordered]), ("steps", shown("steps")),
            ("requests in a step", shown("requests_a_step", ".2f")), ("tokens a step", shown("tokens_a_step", ".2f")),
            ("steps reading no prompt", shown("decoding_steps")), ("ms a step reading no prompt", shown("ms_a_step", ".3f")),
            *[(f"ms of its {part}", [f"{f['parts_ms'][part]:.3f}" for f in figures]) for part in PARTS],
            ("steps reading a prompt", shown("prompt_steps")),
            ("ms a step reading a prompt (median)", shown("prompt_step_ms", ".3f"))]
