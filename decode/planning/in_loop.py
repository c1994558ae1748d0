"""A plan's costs inside a decoding loop: each method's best policy decoded for real, in turns with the baseline,
against the costs of its forwards and drafting measured alone (decode.plan).

The loop runs in a process of its own, with the models loaded again (`FreshProcess`), as a benchmark runs: the
planner's process has replayed hundreds of policies by then, and after that the same decoding runs measurably slower
in it (its host work and its small forwards), which priced every drafting method's step too high."""
import multiprocessing
import signal
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace

import numpy as np
import torch

from decode.api import SpeculativeDecoder
from decode.models.loading import load_draft, load_trigram
from decode.planning import costs, repeats
from decode.planning.search import base_dtype, best, drafter_for, forecast, measured_forecast, with_tree_shapes
from decode.timing.steps import Timer
from decode.timing.turns import decode_in_turns, warm_up

# method -> (the method drafting it, its policy): what a round decodes beside the baseline
Policies = dict[str, tuple[str, dict]]

IN_LOOP_ROUNDS = 2  # rounds of decoding each method's best policy for real, while the best changes under its costs
# a round decodes its prompts in turns again until the baseline has decoded this long (at most IN_LOOP_PASSES times):
# on a shared machine a fraction of a second catches one moment's speed, and the costs of many rows and of one row
# do not move together
IN_LOOP_SECONDS, IN_LOOP_PASSES = 3.0, 10


def steps_of(calls: list) -> list[tuple[int, float]]:
    """(nodes, seconds) of the calls that are decoding steps: a prompt's prefill starts on an empty cache."""
    return [(q, seconds) for q, cached, seconds in calls if cached > 0]


def baseline_costs(calls: list, seconds: float, tokens: int) -> dict:
    """A baseline loop's ms: a prompt's prefill (which yields the first token), a q=1 forward, and the
    rest of a step."""
    prefills = [s for q, cached, s in calls if cached == 0]
    steps = steps_of(calls)
    return {"prefill": 1e3 * sum(prefills) / len(prefills), "one_token": 1e3 * sum(s for _, s in steps) / len(steps),
            "loop": 1e3 * (seconds - sum(s for _, _, s in calls)) / tokens}


def loop_costs(decoder, drafters: dict, prompts, search, oracle_ms: costs.ContextCosts) -> dict:
    """Decoding for real under the `search`'s sampling setting, tokens and seed (a planner.PlanSearch) with the
    baseline and each of `drafters`, in turns per prompt after a warm-up (the prompts again until the baseline has
    decoded for IN_LOOP_SECONDS), as decode.bench runs them (each slows the others' next forwards by evicting their
    weights from the caches). Per drafter: the oracle's forward as a multiple of its isolated cost for the same node
    counts and cached lengths (`oracle_ms`), the drafting's ms per step and the rest of a step's ms (masks,
    verification, commits); for "baseline", its baseline_costs."""
    timers = {name: Timer(decoder.oracle.runtime.synchronize) for name in ["baseline", *drafters]}
    n, sampling = search.max_new_tokens, search.sampling

    def run(name: str, drafter=None):  # how `name` decodes a prompt (the baseline without a drafter)
        hooks, decode = timers[name].hooks(), replace(decoder, drafter=drafter)
        return lambda prompt, i, tokens: decode(prompt, tokens, search.seed + i, sampling, hooks)

    runs = {"baseline": run("baseline")}
    for name, drafter in drafters.items():
        drafter.forget()
        runs[name] = run(name, drafter)
    warm_up(runs, prompts[0], n)
    for timer in timers.values():
        timer.clear()
    passes = []  # per pass, per run: (seconds, tokens)
    for _ in range(IN_LOOP_PASSES):
        passes.append({name: (sum(r["seconds"] for r in rows), sum(len(r["tokens"]) for r in rows))
                       for name, rows in decode_in_turns(runs, prompts, n).items()})
        if sum(p["baseline"][0] for p in passes) >= IN_LOOP_SECONDS:
            break
    seconds = {name: sum(p[name][0] for p in passes) for name in runs}
    tokens = {name: sum(p[name][1] for p in passes) for name in runs}
    measured = {"baseline": baseline_costs(timers["baseline"].forwards, seconds["baseline"], tokens["baseline"])}
    for name in drafters:
        calls, proposing = timers[name].forwards, timers[name].seconds["propose"]
        steps, forwards = [(q, cached) for q, cached, _ in calls if cached > 0], sum(s for _, _, s in calls)
        isolated = float(oracle_ms.at(*zip(*steps)).sum()) / 1e3
        measured[name] = {"oracle": sum(s for _, s in steps_of(calls)) / isolated,
                          "drafting_ms": 1e3 * proposing / len(steps),
                          "loop_ms": 1e3 * (seconds[name] - forwards - proposing) / len(steps),
                          "timing": timing_spread([p["baseline"] for p in passes], [p[name] for p in passes])}
    return measured


class FreshProcess:
    """A process of its own, with the models loaded again as the options load them (and the drafts the policies
    name), where loop_costs decodes these prompts with each round's policies. Use it as a context manager.

    Ctrl-C is the planner's to answer, not the worker's: a terminal sends it to the whole process group, so the worker
    starts with it blocked (a signal mask passes to a child), and the planner ends the worker when it leaves early."""

    def __init__(self, options, prompts: list, search, oracle_ms: costs.ContextCosts):
        self.prompts, self.search, self.oracle_ms = prompts, search, oracle_ms
        self.pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"), initializer=load_models,
                                        initargs=(options, torch.get_num_threads()))
        before = set(multiprocessing.active_children())
        unblocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            self.started = self.pool.submit(int)  # starts the worker, which then loads the models
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, unblocked)
        self.workers = set(multiprocessing.active_children()) - before

    def measure(self, policies: Policies) -> dict:
        """loop_costs of each (method, policy) beside the baseline, under the names `policies` gives them."""
        return self.pool.submit(measure_policies, policies, self.prompts, self.search, self.oracle_ms).result()

    def __enter__(self) -> "FreshProcess":
        return self

    def __exit__(self, kind, *exc) -> None:
        if kind is not None:  # interrupted, or failed: what the worker is measuring is wanted no more
            for worker in self.workers:
                worker.kill()
        self.pool.shutdown()


LOADED: dict = {}  # in a FreshProcess: the decoder, the trigram, the options and the drafts loaded so far


def load_models(options, threads: int) -> None:
    """A FreshProcess's start: torch's threads as the planner's, and the models as the options load them."""
    torch.set_num_threads(threads)
    decoder = SpeculativeDecoder(options).decoder
    LOADED.update(decoder=decoder, options=options, drafts={(0, base_dtype(options)): decoder.draft},
                  table=load_trigram(options, decoder.oracle.vocab_size, decoder.eos_id))


def measure_policies(policies: Policies, prompts: list, search, oracle_ms: costs.ContextCosts) -> dict:
    """In a FreshProcess: loop_costs of each (method, policy), its drafter over the draft the policy names."""
    decoder, options, drafts = LOADED["decoder"], LOADED["options"], LOADED["drafts"]
    drafters = {}
    for name, (method, policy) in policies.items():
        key = (policy.get("draft_vocab", 0), policy.get("draft_dtype") or base_dtype(options))
        if key not in drafts:
            drafts[key] = load_draft(replace(options, draft_vocab=key[0], draft_dtype=key[1]), decoder.oracle.vocab_size)
        drafters[name] = drafter_for(method, policy, drafts[key], LOADED["table"], options)
    return loop_costs(decoder, drafters, prompts, search, oracle_ms)


def timing_spread(baseline: list[tuple[float, int]], method: list[tuple[float, int]]) -> float:
    """How far a measurement of a method's speedup this long may be off by timing alone: the relative spread of its
    speedup (the baseline's seconds a token over its own) from one pass to the next (each pass (seconds, tokens)),
    over the passes' count, counted twice (this measurement and a benchmark's of about its length); 0 from one pass."""
    if len(method) < 2:
        return 0.0
    speedups = np.array([(b / bt) / (m / mt) for (b, bt), (m, mt) in zip(baseline, method)])
    return float(speedups.std(ddof=1) / speedups.mean() * np.sqrt(2 / len(speedups)))


def calibrate_in_loop(measure: Callable[[Policies], dict], remeasure: Callable[[Policies], dict], replays: dict,
                      isolated_ms: costs.ContextCosts) -> tuple[dict, dict]:
    """Each method's costs in a real decoding loop, beside the baseline's (`measure`: loop_costs of these policies,
    as FreshProcess.measure gives them): first with the context drafter (no draft model) standing for every method,
    then with each method's best policy under the costs measured so far, which gives that policy its own factors (the
    draft's and the oracle's forwards evict each other from the caches, by amounts that differ with the draft's dtype
    and output layer); a method whose best policy changes under its factors has the new one measured too, up to
    IN_LOOP_ROUNDS. Last, each method's best is measured again by `remeasure`, another process's (a benchmark runs
    in a process of its own, minutes later): how far the two lie apart is part of the forecast's timing error
    (search.measured_forecast). Per method, the policies measured, each as (its candidate, its factors), staged's
    and the tree's shared (`with_tree_shapes`); and the baseline measured beside the last of them. A round's factors
    are scaled to the last round's speed (`at_speed`): a shared machine runs minutes apart at speeds a quarter apart,
    and a method's costs count against the baseline's measured beside them."""
    generic = measure({"lookup": ("lookup", {})})
    baseline = generic["baseline"]
    stand_in = (None, generic["lookup"] | {"drafting": 1.0}, baseline["one_token"])  # for a method not yet measured
    rounds: dict[str, list] = {method: [] for method in replays}  # (candidate, factors, the baseline's one-token ms beside them)

    def record(now: dict, chosen: dict) -> dict:
        for method, c in chosen.items():
            replay_ms = repeats.replayed_drafting_ms(c)
            m = now[method]
            factors = {"oracle": m["oracle"], "loop_ms": m["loop_ms"], "timing": m["timing"],
                       "drafting": m["drafting_ms"] / replay_ms if replay_ms > 0 else 1.0}
            rounds[method].append((c, factors, now["baseline"]["one_token"]))
        return now["baseline"]

    for _ in range(IN_LOOP_ROUNDS):
        latest = {method: (rounds[method] or [stand_in])[-1] for method in replays}
        in_loop = {method: at_speed(f, one_token, baseline) for method, (_, f, one_token) in latest.items()}
        leading = best(forecast(replays, isolated_ms, baseline, in_loop))
        chosen = {method: next(c for c in group if c["policy"] == leading[method]["policy"])
                  for method, group in replays.items()}
        chosen = {method: c for method, c in chosen.items() if all(c is not done for done, _, _ in rounds[method])}
        if not chosen:
            break
        baseline = record(measure({method: (method, c["policy"]) for method, c in chosen.items()}), chosen)
    so_far = measured_at(rounds, baseline)
    leading, _ = measured_forecast(so_far, isolated_ms, baseline)
    chosen = {method: next(c for c, _ in so_far[method] if c["policy"] == leading[method]["policy"]) for method in replays}
    baseline = record(remeasure({method: (method, c["policy"]) for method, c in chosen.items()}), chosen)
    return measured_at(rounds, baseline), baseline


def measured_at(rounds: dict, baseline: dict) -> dict:
    """Per method, (candidate, factors) of each measurement in `rounds` at the speed of `baseline`'s, staged's and
    the tree's shared."""
    return with_tree_shapes({method: [(c, at_speed(f, one_token, baseline)) for c, f, one_token in entries]
                             for method, entries in rounds.items()})


def at_speed(factors: dict, one_token_ms: float, baseline: dict) -> dict:
    """A method's in-loop factors, measured beside a baseline whose one-token forward took `one_token_ms`, at the
    speed of the machine when `baseline` was measured: its oracle forwards, drafting and loop all scaled by the
    ratio of the two baselines' one-token forwards (the timing spread, a ratio, as it is)."""
    speed = baseline["one_token"] / one_token_ms
    return {"oracle": factors["oracle"] * speed, "drafting": factors["drafting"] * speed,
            "loop_ms": factors["loop_ms"] * speed, "timing": factors["timing"]}
