"""Timing a decoding step's parts from outside the loop: `Hooks` wrap what the loop is given (the oracle's forward,
the drafter, the verification rule) and report each call's seconds; a `Timer` adds them up by label, for the tools
that time decoding (decode.bench, decode.plan, decode.profile_step)."""
import time
from collections import defaultdict
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch

if TYPE_CHECKING:
    from decode.drafting import Drafter
    from decode.models.cached_lm import CachedLM, Call


@dataclass
class Hooks:
    """Told the seconds each part of a step took: the oracle's forwards (with the nodes they scored and the slots
    cached before them: none for a prompt's), the drafter's proposals and the verifications. The loop is given its
    parts wrapped (`run`, `drafter`, `verify`); a part whose hook is None is given as it is. Each timing waits for
    the device work queued before it and for its own (`synchronize`: the oracle's runtime's, on a GPU)."""

    on_forward: Callable[[int, int, float], None] | None = None
    on_propose: Callable[[float], None] | None = None
    on_verify: Callable[[float], None] | None = None
    synchronize: Callable[[], None] = lambda: None

    def clock(self) -> float:
        self.synchronize()
        return time.perf_counter()

    def timed(self, call: Callable, report: Callable[[float], None] | None) -> Callable:
        """`call`, reporting its seconds to `report` (none: `call` itself)."""
        if report is None:
            return call

        def timed_call(*args, **kwargs):
            start = self.clock()
            try:
                return call(*args, **kwargs)
            finally:
                report(self.clock() - start)

        return timed_call

    def run(self, model: "CachedLM") -> Callable[["Call"], torch.Tensor]:
        """`model.run`, each call reported to on_forward."""
        report = self.on_forward
        if report is None:
            return model.run

        def timed_run(call: "Call") -> torch.Tensor:
            cached, start = model.length + model.pending, self.clock()
            try:
                return model.run(call)
            finally:
                report(len(call.token_ids), cached, self.clock() - start)

        return timed_run

    def drafter(self, drafter: "Drafter") -> "Drafter":
        """`drafter`, each proposal reported to on_propose."""
        if self.on_propose is None:
            return drafter
        return cast("Drafter", TimedProposals(drafter, self.timed(drafter.propose, self.on_propose)))

    def verify(self, rule: Callable) -> Callable:
        """The verification `rule`, each call reported to on_verify."""
        return self.timed(rule, self.on_verify)


class TimedProposals:
    """A drafter whose `propose` is another callable (a timed one); everything else is the drafter's."""

    def __init__(self, drafter: "Drafter", propose: Callable):
        self.drafter, self.propose = drafter, propose

    def __getattr__(self, name: str):
        return getattr(self.drafter, name)


UNTIMED = Hooks()


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

    def hooks(self, label: str = "") -> Hooks:
        """The loop's hooks, adding to "oracle prompt" (a forward at an empty cache) and "oracle forward",
        "propose" and "verification", each label prefixed by `label`; each forward is also logged in `forwards`."""

        def on_forward(nodes: int, cached: int, seconds: float) -> None:
            self.add(f"{label}oracle {'forward' if cached else 'prompt'}", seconds)
            self.forwards.append((nodes, cached, seconds))

        return Hooks(on_forward, lambda s: self.add(f"{label}propose", s), lambda s: self.add(f"{label}verification", s),
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
