"""The comparison the tools that check decoding share (decode.bench, decode.agreement): each method's greedy output
against the baseline's."""
from collections.abc import Callable
from typing import Any

from decode.healing import Prompt

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
