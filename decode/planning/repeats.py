"""A policy measured in a decoding loop more than once (by two methods that draft it alike, or again in another
process minutes later): its measurements pooled into one set of factors, and the spread between measurements of one
policy, which is how far a benchmark's own measurement may lie from them.

A measurement's factors (decode/planning/in_loop.py) scale the costs measured alone: the oracle's forward, the drafting
(as a ratio to the drafting its candidate's replay timed) and the rest of a step (ms), with `timing`, the relative
spread of the speedup the passes of one measurement gave."""
import json
import math

import numpy as np

FACTORS = ("oracle", "drafting", "loop_ms")


def grouped(pairs: list[tuple[dict, dict]]) -> list[tuple[dict, list[dict]]]:
    """One method's (candidate, factors) pairs gathered per policy: its first candidate, and every measurement's
    factors with the drafting's ratio taken to that candidate's replay."""
    groups: dict[str, tuple[dict, list[dict]]] = {}
    for c, f in pairs:
        first, measurements = groups.setdefault(json.dumps(c["policy"], sort_keys=True), (c, []))
        first_ms = replayed_drafting_ms(first)
        measurements.append(f | {"drafting": f["drafting"] * replayed_drafting_ms(c) / first_ms}
                            if c is not first and first_ms > 0 else f)
    return list(groups.values())


def replayed_drafting_ms(candidate: dict) -> float:
    replayed = candidate["replay"]
    return 1e3 * replayed.drafting_seconds / max(replayed.steps, 1)


def spread_between(speedups: list[list[float]]) -> float | None:
    """How far one measurement's speedup lies from another's of the same policy, relatively: the standard deviation
    of the logarithms of each policy's speedups (`speedups`, per policy, one per measurement) about their mean, pooled
    over the policies (one measured once adds nothing); None where none was measured more than once."""
    logs = [np.log(s) for s in speedups]
    dof = sum(len(s) - 1 for s in logs)
    if not dof:
        return None
    return float(np.sqrt(sum(((s - s.mean()) ** 2).sum() for s in logs) / dof))


def pooled(measurements: list[dict], spread: float | None) -> dict:
    """One policy's factors from its measurements: their mean; and as timing, the larger of their own and, with
    `spread` (spread_between), how far a benchmark's measurement may lie from the mean of these n: spread * sqrt(1 +
    1/n)."""
    timing = max(f.get("timing", 0.0) for f in measurements)
    if spread is not None:
        timing = max(timing, spread * math.sqrt(1 + 1 / len(measurements)))
    return {k: float(np.mean([f[k] for f in measurements])) for k in FACTORS} | {"timing": timing}
