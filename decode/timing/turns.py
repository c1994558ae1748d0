"""Decoding every prompt with each method in turns, as the tools that compare methods' speeds do (decode.bench, the
planner's in-loop measurement)."""
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from tqdm import tqdm

if TYPE_CHECKING:
    from decode.healing import Prompt
    from decode.loop import Generation

# (prompt, its index, how many tokens) -> the Generation of one decoding of it
Run = Callable[["Prompt", int, int], "Generation"]
WARMUP_TOKENS = 16


def in_turns(names: list[str], i: int) -> list[str]:
    """The order the methods decode prompt i in: rotated by one each prompt, so that none always runs right after
    another (each slows the next one's first forwards by evicting its weights from the caches)."""
    return names[i % len(names):] + names[: i % len(names)]


def warm_up(runs: dict[str, Run], prompt: "Prompt", max_new_tokens: int) -> None:
    """Every method decodes a few tokens of `prompt`, before any timing: a process's first forwards of each shape
    allocate, build kernels and fill caches."""
    for run in runs.values():
        run(prompt, 0, min(WARMUP_TOKENS, max_new_tokens))


def decode_in_turns(runs: dict[str, Run], prompts: list["Prompt"], max_new_tokens: int,
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
