"""Greedy decoding makes planning exact: on a calibration prompt, the oracle's continuation after any accepted
prefix is the rest of its own greedy output, so a drafter can be replayed along it with no oracle call, and the
tokens it would have accepted are counted, step by step, as decoding would.

    replay       a drafter with a given policy, along the oracle's greedy outputs: tokens per call,
                 drafting time per step (measured here) and the oracle's batch per step
    sampled      the same figures when sampling, whose acceptance is random: from decoding for real
    predict      tokens per call, ms per token and speedup, from a replay and the oracle's forward
                 costs (its own, or a larger shape's for a projection; the draft's forwards too can be priced
                 at a larger shape's costs), with the speedup's interval over the calibration prompts (`interval`)
"""
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np

from decode.drafting import Drafter
from decode.planning.costs import ContextCosts
from decode.sampling import GREEDY, Sampling, Uniforms
from decode.timing.steps import Hooks

if TYPE_CHECKING:
    from decode.decoder import Decoder


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
    draft_forwards: list[tuple[int, int]] = field(default_factory=list)  # each draft forward's (rows, cached positions)
    draft_seconds: float = 0.0  # the part of drafting_seconds spent in the draft model's forwards

    def accepted_by_depth(self, depth: int) -> list[float]:
        """Share of steps that accept at least d drafted tokens, d = 1 .. depth."""
        a = np.array(self.accepted)
        return [float((a >= d).mean()) for d in range(1, depth + 1)]


class RecordedDraft:
    """A draft model whose forwards are recorded into a Replay: the rows and cached positions of each, and the time
    they take (the device synchronised), so that a projection can price them at another model's costs."""

    def __init__(self, model, out: Replay):
        self.model, self.out = model, out

    def __getattr__(self, name: str):
        return getattr(self.model, name)

    def timed(self, run, rows: list[int]):
        cached = self.model.length + self.model.pending
        self.model.runtime.synchronize()
        start = time.perf_counter()
        result = run()
        self.model.runtime.synchronize()
        self.out.draft_seconds += time.perf_counter() - start
        self.out.draft_forwards += [(n, cached + sum(rows[:i])) for i, n in enumerate(rows)]
        return result

    def forward(self, token_ids, position_ids, mask, last=None):
        return self.timed(lambda: self.model.forward(token_ids, position_ids, mask, last), [len(token_ids)])

    def chain(self, token_ids, position_ids, steps: int, sampling, uniforms):
        """One call, `steps` forwards: the first over the new tokens, each later one over one token."""
        return self.timed(lambda: self.model.chain(token_ids, position_ids, steps, sampling, uniforms),
                          [len(token_ids)] + [1] * (steps - 1))


@contextmanager
def recording(drafter: Drafter, out: Replay):
    """While in the block, the forwards of the drafter's draft model (if it has one) are recorded into `out`."""
    cache = getattr(drafter, "draft", None)
    if cache is None:
        yield
        return
    model, cache.model = cache.model, RecordedDraft(cache.model, out)
    try:
        yield
    finally:
        cache.model = model


def replay(drafter: Drafter, sequences: list[tuple[list[int], list[int]]]) -> Replay:
    """Decode each (prompt, continuation) as greedy speculative decoding would, with the oracle's
    answer taken from the continuation: the accepted path is the longest branch that spells it. The
    drafter starts as a new decoder's does, with no trigram trees remembered."""
    out = Replay()
    with recording(drafter, out):
        drafter.forget()
        for prompt, continuation in sequences:
            replay_prompt(drafter, prompt, continuation, out)
    return out


def replay_prompt(drafter: Drafter, prompt: list[int], continuation: list[int], out: Replay) -> None:
    """`replay` on one prompt, its steps added to `out`."""
    drafter.reset()
    tokens, done = list(prompt), 0
    while done < len(continuation):
        start = time.perf_counter()
        tree = drafter.propose(tokens, len(continuation) - done - 1, GREEDY, Uniforms())
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


class Recorded:
    """A drafter whose accepted paths are recorded: drafted tokens accepted per step."""

    def __init__(self, drafter: Drafter, accepted: list[int]):
        self.drafter, self.accepted = drafter, accepted

    def __getattr__(self, name: str):
        return getattr(self.drafter, name)

    def accept(self, path: list[int]) -> None:
        self.accepted.append(len(path) - 1)
        self.drafter.accept(path)


def sampled(drafter: Drafter, decoder: "Decoder", prompts: list, max_new_tokens: int, sampling: Sampling,
            seed: int) -> Replay:
    """What a drafter does when sampling, from decoding each prompt (a healed Prompt) for real: prompt i draws with
    seed + i, as decode.bench does. Sampled acceptance is random, so no replay along one output stands for it; the
    oracle's forwards are counted here, and costed by `predict` as a replay's are. `decoder`: the models it decodes
    with (its own drafter is not used)."""
    out = Replay()

    def on_forward(nodes: int, cached: int, seconds: float) -> None:
        if cached:  # a step's forward, not a prompt's
            out.nodes.append(nodes)
            out.cached.append(cached)
            out.step_prompts.append(out.prompts)

    hooks = Hooks(on_forward=on_forward,
                  on_propose=lambda seconds: setattr(out, "drafting_seconds", out.drafting_seconds + seconds),
                  synchronize=decoder.oracle.runtime.synchronize)
    decode = replace(decoder, drafter=Recorded(drafter, out.accepted))
    with recording(drafter, out):
        drafter.forget()
        for i, prompt in enumerate(prompts):
            generation = decode(prompt, max_new_tokens, seed + i, sampling, hooks)
            out.tokens += len(generation.tokens)
            out.prompt_tokens.append(len(generation.tokens))
            out.prompts += 1
    out.steps = len(out.nodes)
    return out


def predict(replayed: Replay, oracle_ms: ContextCosts, loop_ms: float, prefill_ms: float,
            drafting_factor: float = 1.0, draft_ms: ContextCosts | None = None) -> dict:
    """Tokens per oracle call and ms per token: per prompt, the prefill (`prefill_ms`: one oracle call
    over the prompt, which yields no token when a tree follows); per step, the oracle's forward over
    the tree (`oracle_ms`, measured for q nodes after several cached lengths: priced at the step's own), the drafting measured in the replay (times
    `drafting_factor`: in a decoding loop the oracle's forwards evict the draft from the caches) and
    the rest of the loop (`loop_ms`, measured). With `draft_ms` (another draft's ms per forward of q rows after c
    cached positions), the draft's recorded forwards are priced at it instead of their measured time. `prompt_ms`:
    the same time, prompt by prompt (the drafting shared by steps)."""
    step_ms = oracle_ms.at(replayed.nodes, replayed.cached).numpy()
    oracle = float(step_ms.sum())
    drafting = 1e3 * replayed.drafting_seconds * drafting_factor
    if draft_ms is not None and replayed.draft_forwards:
        priced = float(draft_ms.at(*zip(*replayed.draft_forwards)).sum())
        drafting += priced - 1e3 * replayed.draft_seconds * drafting_factor
    total = prefill_ms * replayed.prompts + oracle + drafting + loop_ms * replayed.steps
    per_step = step_ms + (drafting / max(replayed.steps, 1) + loop_ms)
    prompt_ms = prefill_ms + np.bincount(replayed.step_prompts, per_step, minlength=replayed.prompts)
    return {"tokens_per_call": replayed.tokens / (replayed.steps + replayed.prompts), "ms_per_token": total / replayed.tokens,
            "oracle_ms_per_call": oracle / replayed.steps,
            "drafting_ms_per_call": drafting / replayed.steps,
            "mean_nodes": float(np.mean(replayed.nodes)), "prompt_ms": prompt_ms}


def interval(baseline_ms: np.ndarray, method_ms: np.ndarray, timing: float = 0.0, share: float = 0.9,
             draws: int = 2000) -> list[float]:
    """The speedup (the baseline's time over the method's, both summed over prompts) that a benchmark of as many
    other prompts like the calibration's would measure, with a relative timing error of spread `timing`: the central
    `share` of its values over `draws` draws (a fixed seed: a plan is reproducible). Each draw moves the calibration's
    speedup twice, by two independent resamplings of its prompts with replacement (how far the calibration's set may
    lie from the speedup of all such prompts, and how far the benchmark's set lies from that), and times a draw of the
    timing's error. Prompt i took baseline_ms[i] and method_ms[i]."""
    rng = np.random.default_rng(0)
    speedup = baseline_ms.sum() / method_ms.sum()

    def resampled() -> np.ndarray:
        picks = rng.integers(0, len(method_ms), (draws, len(method_ms)))
        return baseline_ms[picks].sum(1) / method_ms[picks].sum(1)

    speedups = resampled() * (resampled() / speedup) * np.exp(rng.normal(0.0, timing, draws))
    return [float(v) for v in np.quantile(speedups, [(1 - share) / 2, (1 + share) / 2])]


def draft_costs(draft_ms: dict | None, policy: dict) -> ContextCosts | None:
    """A projected draft's costs for this policy's draft: `draft_ms` is keyed by (shortlist size, dtype), as the
    policy's draft_vocab and draft_dtype say (None: the policy has no draft model, or nothing is projected)."""
    if draft_ms is None or "draft_vocab" not in policy:
        return None
    return draft_ms[policy["draft_vocab"] or 0, policy["draft_dtype"]]


def baseline_prompt_ms(replayed: Replay, baseline: dict) -> np.ndarray:
    """The baseline's time on each prompt of a replay, from its costs (`baseline`: prefill, one_token and loop ms):
    the prefill yields the first token, one forward each yields the others."""
    outputs = np.array(replayed.prompt_tokens, dtype=np.float64)
    return baseline["prefill"] + (outputs - 1) * baseline["one_token"] + outputs * baseline["loop"]


def ranked(candidates: list[dict], oracle_ms: ContextCosts, loop_ms: float, prefill_ms: float, baseline_ms: float,
           drafting_factor: float = 1.0, baseline: dict | None = None, draft_ms: dict | None = None,
           timing: float = 0.0) -> list[dict]:
    """The candidate policies with their predictions, least predicted ms per token first; with the baseline's costs
    (`baseline_prompt_ms`), each speedup's interval over the calibration prompts and the in-loop measurement's
    `timing` spread (`interval`). With `draft_ms`, the draft's forwards of each policy priced at the costs it holds
    for the policy's draft (`draft_costs`)."""
    out = []
    for c in candidates:
        p = predict(c["replay"], oracle_ms, loop_ms, prefill_ms, drafting_factor, draft_costs(draft_ms, c["policy"]))
        prompt_ms = p.pop("prompt_ms")
        spread = {} if baseline is None else {
            "speedup_interval": interval(baseline_prompt_ms(c["replay"], baseline), prompt_ms, timing)}
        out.append({"policy": c["policy"], **p, "speedup": baseline_ms / p["ms_per_token"], **spread,
                    "accepted_by_depth": c["replay"].accepted_by_depth(8)})
    return sorted(out, key=lambda c: c["ms_per_token"])
