"""Greedy decoding makes planning exact: on a calibration prompt, the oracle's continuation after any accepted
prefix is the rest of its own greedy output, so a drafter can be replayed along it with no oracle call, and the
tokens it would have accepted are counted, step by step, as decoding would.

    replay       a drafter with a given policy, along the oracle's greedy outputs: tokens per call,
                 drafting time per step (measured here) and the oracle's batch per step
    sampled      the same figures when sampling, whose acceptance is random: from decoding for real
    predict      tokens per call, ms per token and speedup, from a replay and the oracle's forward
                 costs (its own, or a larger shape's for a projection), with the speedup's interval over the
                 calibration prompts (`interval`)
"""
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from decode import loop
from decode.drafting import Drafter
from decode.loop import Hooks
from decode.planning.costs import ContextCosts
from decode.sampling import Sampling

GREEDY = Sampling()


@dataclass
class Replay:
    """What a drafter did along the oracle's greedy outputs."""

    prompts: int = 0
    steps: int = 0
    tokens: int = 0
    drafting_seconds: float = 0.0  # proposing and committing, measured
    nodes: list[int] = field(default_factory=list)  # the oracle's batch per step
    accepted: list[int] = field(default_factory=list)  # drafted tokens accepted per step
    cached: list[int] = field(default_factory=list)  # the oracle's cached positions before each step's forward
    step_prompts: list[int] = field(default_factory=list)  # the prompt of each step (its index)
    prompt_tokens: list[int] = field(default_factory=list)  # the tokens of each prompt's output

    def accepted_by_depth(self, depth: int) -> list[float]:
        """Share of steps that accept at least d drafted tokens, d = 1 .. depth."""
        a = np.array(self.accepted)
        return [float((a >= d).mean()) for d in range(1, depth + 1)]


def replay(drafter: Drafter, sequences: list[tuple[list[int], list[int]]]) -> Replay:
    """Decode each (prompt, continuation) as greedy speculative decoding would, with the oracle's
    answer taken from the continuation: the accepted path is the longest branch that spells it. The
    drafter starts as a new decoder's does, with no trigram trees remembered."""
    drafter.forget()
    out = Replay()
    for prompt, continuation in sequences:
        drafter.reset()
        tokens, done = list(prompt), 0
        while done < len(continuation):
            start = time.perf_counter()
            tree = drafter.propose(tokens, len(continuation) - done - 1, GREEDY, None)
            path = [0]
            while done + len(path) < len(continuation):
                want = continuation[done + len(path) - 1]
                child = next((c for c in tree.children[path[-1]] if tree.tokens[c] == want), None)
                if child is None:
                    break
                path.append(child)
            drafter.accept(path)
            out.drafting_seconds += time.perf_counter() - start
            tokens += continuation[done : done + len(path)]  # the accepted nodes and the oracle's next token
            done += len(path)
            out.steps += 1
            out.nodes.append(len(tree))
            out.cached.append(len(tokens) - len(path) - 1)  # the oracle had seen all but the step's root
            out.accepted.append(len(path) - 1)
            out.step_prompts.append(out.prompts)
        out.tokens += len(continuation)
        out.prompt_tokens.append(len(continuation))
        out.prompts += 1
    return out


class Recorded:
    """A drafter whose accepted paths are recorded: drafted tokens accepted per step."""

    def __init__(self, drafter: Drafter, accepted: list[int]):
        self.drafter, self.accepted = drafter, accepted

    def __getattr__(self, name: str):
        return getattr(self.drafter, name)

    def accept(self, path: list[int]) -> None:
        self.accepted.append(len(path) - 1)
        self.drafter.accept(path)


def sampled(drafter: Drafter, oracle, prompts: list, max_new_tokens: int, sampling: Sampling, eos_id: int | None,
            seed: int) -> Replay:
    """What a drafter does when sampling, from decoding each prompt (a healed Prompt) for real: prompt i draws with
    seed + i, as decode.bench does. Sampled acceptance is random, so no replay along one output stands for it; the
    oracle's forwards are counted here, and costed by `predict` as a replay's are."""
    drafter.forget()
    out = Replay()
    hooks = Hooks(on_forward=lambda nodes, cached, seconds: cached and (out.nodes.append(nodes), out.cached.append(cached),
                                                                        out.step_prompts.append(out.prompts)),
                  on_propose=lambda seconds: setattr(out, "drafting_seconds", out.drafting_seconds + seconds),
                  device=oracle.device)
    recorded = Recorded(drafter, out.accepted)
    for i, prompt in enumerate(prompts):
        generator = torch.Generator(oracle.device).manual_seed(seed + i)
        generation = loop.tree_speculative(oracle, prompt.ids, max_new_tokens, sampling, eos_id, generator=generator,
                                           drafter=recorded, allowed=prompt.allowed, hooks=hooks)
        out.tokens += len(generation.tokens)
        out.prompt_tokens.append(len(generation.tokens))
        out.prompts += 1
    out.steps = len(out.nodes)
    return out


def predict(replayed: Replay, oracle_ms: ContextCosts, loop_ms: float, prefill_ms: float,
            drafting_factor: float = 1.0) -> dict:
    """Tokens per oracle call and ms per token: per prompt, the prefill (`prefill_ms`: one oracle call
    over the prompt, which yields no token when a tree follows); per step, the oracle's forward over
    the tree (`oracle_ms`, measured for q nodes after several cached lengths: priced at the step's own), the drafting measured in the replay (times
    `drafting_factor`: in a decoding loop the oracle's forwards evict the draft from the caches) and
    the rest of the loop (`loop_ms`, measured). `prompt_ms`: the same time, prompt by prompt (the drafting
    shared by steps)."""
    step_ms = oracle_ms.at(replayed.nodes, replayed.cached).numpy()
    oracle = float(step_ms.sum())
    drafting = 1e3 * replayed.drafting_seconds * drafting_factor
    total = prefill_ms * replayed.prompts + oracle + drafting + loop_ms * replayed.steps
    per_step = step_ms + (drafting / max(replayed.steps, 1) + loop_ms)
    prompt_ms = prefill_ms + np.bincount(replayed.step_prompts, per_step, minlength=replayed.prompts)
    return {"tokens_per_call": replayed.tokens / (replayed.steps + replayed.prompts), "ms_per_token": total / replayed.tokens,
            "oracle_ms_per_call": oracle / replayed.steps,
            "drafting_ms_per_call": drafting / replayed.steps,
            "mean_nodes": float(np.mean(replayed.nodes)), "prompt_ms": prompt_ms}


def interval(baseline_ms: np.ndarray, method_ms: np.ndarray, share: float = 0.9, draws: int = 2000) -> list[float]:
    """The speedup (the baseline's time over the method's, both summed over prompts) over other sets of prompts like
    the calibration's: the central `share` of its values over `draws` resamplings of the prompts with replacement
    (a fixed seed: a plan is reproducible). Prompt i took baseline_ms[i] and method_ms[i]."""
    picks = np.random.default_rng(0).integers(0, len(method_ms), (draws, len(method_ms)))
    speedups = baseline_ms[picks].sum(1) / method_ms[picks].sum(1)
    return [float(v) for v in np.quantile(speedups, [(1 - share) / 2, (1 + share) / 2])]


def baseline_prompt_ms(replayed: Replay, baseline: dict) -> np.ndarray:
    """The baseline's time on each prompt of a replay, from its costs (`baseline`: prefill, one_token and loop ms):
    the prefill yields the first token, one forward each yields the others."""
    outputs = np.array(replayed.prompt_tokens, dtype=np.float64)
    return baseline["prefill"] + (outputs - 1) * baseline["one_token"] + outputs * baseline["loop"]


def ranked(candidates: list[dict], oracle_ms: ContextCosts, loop_ms: float, prefill_ms: float, baseline_ms: float,
           drafting_factor: float = 1.0, baseline: dict | None = None) -> list[dict]:
    """The candidate policies with their predictions, least predicted ms per token first; with the baseline's costs
    (`baseline_prompt_ms`), each speedup's interval over the calibration prompts (`interval`)."""
    out = []
    for c in candidates:
        p = predict(c["replay"], oracle_ms, loop_ms, prefill_ms, drafting_factor)
        prompt_ms = p.pop("prompt_ms")
        spread = {} if baseline is None else {
            "speedup_interval": interval(baseline_prompt_ms(c["replay"], baseline), prompt_ms)}
        out.append({"policy": c["policy"], **p, "speedup": baseline_ms / p["ms_per_token"], **spread,
                    "accepted_by_depth": c["replay"].accepted_by_depth(8)})
    return sorted(out, key=lambda c: c["ms_per_token"])
