"""The planner's search: the policies it weighs for each method, and how they are ranked.

`candidates` lists every policy within a budget and a depth (chains, the shapes Sequoia's search finds for the draft's
acceptance, staged's trees over trigram widths, lookup lengths); `replay_policies` replays them on calibration prompts
(a cheap screen, then the finalists on all); `forecast` prices each replay under an oracle cost curve and the costs a
real decoding loop adds, and ranks them. decode.plan (decode/cli/plan.py) measures those costs and writes the plan.
"""
from collections.abc import Callable
from dataclasses import replace

from tqdm import tqdm

from decode.methods import METHODS
from decode.plan_file import with_policy
from decode.planning import kinds, repeats, replay, shapes
from decode.planning.costs import ContextCosts
from decode.sampling import GREEDY, Sampling

BUDGETS = (4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)
# Six trigram levels, and three (the draft's best children add a fourth): shallow and wide was the cpu preset's best
STAGED_WIDTHS = ((1, 1, 1, 1, 1, 1), (2, 1, 1, 1, 1, 1), (2, 2, 1, 1, 1, 1), (3, 2, 2, 1, 1, 1), (4, 3, 2, 1, 1, 1),
                 (6, 4, 2, 1, 1, 1), (3, 2, 1), (4, 2, 1), (6, 3, 1))
CHAIN_K = range(1, 9)
LOOKUP_TOKENS = (1, 2, 3, 4, 6, 8, 10, 12, 16)
# staged on a planned shape: the trigram's tree guessed below each node a draft call scores, or no stage below the
# draft (its tree alone, as the tree method drafts it: where guesses and copies save less than they cost)
STAGED_GUESSES = ((), (1,), (2,))
STAGED_DRAWS = (1, 2)  # when sampling: the draft's draws per node of a staged tree (1: a chain of draws)
STAGED_DRAFT_CALLS = (1, 2, 3, 5, 8)  # greedy: the most draft calls a staged step makes down its best path
RANKS = 8  # candidates per node the acceptance rates cover
FINALISTS = 3  # policies per method (and per oracle cost) replayed on every calibration prompt


def candidates(options, draft, table, p_draft, max_budget: int, max_depth: int,
               sampling: Sampling = GREEDY) -> list[tuple[str, dict, object]]:
    """(method, policy, drafter) for every policy to replay: trees of at most `max_budget` nodes and `max_depth`
    levels; staged's with each of STAGED_DRAFT_CALLS, or when sampling its trees of draws with each of STAGED_DRAWS
    per node."""
    drafted = {"draft_vocab": 0, "draft_dtype": base_dtype(options)}  # the draft the plan loaded; other drafts later
    policies = [("speculative", {"k": k} | drafted) for k in CHAIN_K]
    budgets = [b for b in BUDGETS if b <= max_budget]
    seen = set()
    for depth in range(1, max_depth + 1):
        best = shapes.best_shapes(p_draft, max_budget, depth)
        for n in budgets:
            shape = best[n]
            key = shape and (tuple(shape.parents), tuple(shape.ranks))
            if shape and key not in seen:
                seen.add(key)
                planned = {"parents": shape.parents, "ranks": shape.ranks, "expected": shape.expected,
                           "nodes": len(shape.parents), "depth": shape.depth}
                policies.append(("tree", planned | drafted))
                policies += [("staged", planned | {"widths": list(widths)} | drafted) for widths in STAGED_GUESSES
                             if shape.depth > 1]
    draws = ([{"draft_calls": n} for n in STAGED_DRAFT_CALLS] if sampling.greedy
             else [{"branch": n} for n in STAGED_DRAWS])
    for widths in STAGED_WIDTHS:
        policies += [("staged", {"widths": list(widths), "budget": budget} | drawn | drafted)
                     for budget in budgets if budget > widths[0] for drawn in draws]
    policies += [("ngram", {"widths": options.widths, "budget": budget}) for budget in budgets if budget > options.widths[0]]
    policies += [("lookup", {"tokens": length}) for length in LOOKUP_TOKENS]
    return [(method, policy, drafter_for(method, policy, draft, table, options)) for method, policy in policies]


def drafter_for(method: str, policy: dict, draft, table, options):
    """The drafter that drafts `method`'s `policy` with this draft model."""
    make = METHODS[method].drafter
    assert make is not None, "a planned method drafts"
    return make(with_policy(replace(options, method=method), policy), draft, table)


def base_dtype(options) -> str:
    return options.draft_dtype or options.dtype


def variant_name(size: int, dtype: str) -> str:
    return f"{f'{size} tokens' if size else 'every token'} in {dtype}"


def replay_all(candidates: list, replayer: Callable, prompts: int, desc: str) -> dict:
    """Per method, each candidate policy with its drafter and its replay on the first `prompts` calibration prompts
    (`replayer(drafter, prompts)`)."""
    replays: dict[str, list[dict]] = {}
    for method, policy, drafter in tqdm(candidates, desc=desc, unit="policy"):
        replays.setdefault(method, []).append({"policy": policy, "drafter": drafter, "replay": replayer(drafter, prompts)})
    return replays


def replay_policies(options, draft, table, p_draft, run_replay: Callable, prompts: int, oracle_curves: list,
                    drafts: dict, sampling: Sampling, screen: int, max_budget: int, max_depth: int) -> dict:
    """Every candidate policy (`candidates`) replayed on the first `screen` of the `prompts` calibration prompts, each method's best
    few under each oracle curve on all of them, and a draft method's best few again with each of the other `drafts`
    (a cheaper draft may favour a larger tree): per method, each policy with its drafter and replay."""
    screened = replay_all(candidates(options, draft, table, p_draft, max_budget, max_depth, sampling),
                          run_replay, screen, f"screening policies on {min(screen, prompts)} prompts")
    finalists = leaders(screened, FINALISTS, oracle_curves)
    finalists += [f for f in kind_leaders(screened, oracle_curves[0]) if f[:2] not in [g[:2] for g in finalists]]
    replays = replay_all(finalists, run_replay, prompts, f"replaying the finalists on {prompts} prompts")
    if drafts:
        drafted = {method: group for method, group in replays.items() if "draft_vocab" in group[0]["policy"]}
        variants = [(method, policy | {"draft_vocab": n, "draft_dtype": dtype}, drafter_for(method, policy, variant, table, options))
                    for method, policy, _ in leaders(drafted, FINALISTS, oracle_curves[:1])  # this device's finalists
                    for (n, dtype), variant in drafts.items()]
        for method, group in replay_all(variants, run_replay, prompts, "replaying them with the draft over "
                                        + "; ".join(variant_name(*key) for key in drafts)).items():
            replays[method] += group
    return replays


def outside_a_loop(replays: dict) -> dict:
    """Each method's factors with drafting and the loop as measured outside a decoding loop (`forecast`'s in_loop)."""
    return {method: {"oracle": 1.0, "drafting": 1.0, "loop_ms": 0.0} for method in replays}


def leaders(replays: dict, keep: int, oracle_curves: list[tuple]) -> list[tuple[str, dict, object]]:
    """(method, policy, drafter) for each method's `keep` best policies of `replays` under each of
    `oracle_curves` (the oracle's ms per node count, the baseline's costs, and a projected draft's costs or None),
    with drafting and the loop as measured outside a decoding loop."""
    plain = outside_a_loop(replays)
    return [(method, c["policy"], c["drafter"]) for method, group in replays.items()
            for c in unique_best(group, [forecast({method: group}, ms, baseline, plain, keep, draft_ms)
                                         for ms, baseline, draft_ms in oracle_curves], method)]


def kind_leaders(replays: dict, oracle_curve: tuple) -> list[tuple[str, dict, object]]:
    """(method, policy, drafter) of the best policy of each kind of tree (planning.kinds) among `replays` under
    `oracle_curve`, so that the finalists hold every kind's best: the plan shows what each would give."""
    ms, baseline, draft_ms = oracle_curve
    ranked = forecast(replays, ms, baseline, outside_a_loop(replays), None, draft_ms)
    return [(method, p["policy"], next(c["drafter"] for c in replays[method] if c["policy"] == p["policy"]))
            for method, p in kinds.best_of_each_kind(ranked).values()]


def unique_best(group: list[dict], forecasts: list[dict], method: str) -> list[dict]:
    """The candidates of `group` among the ranked policies of any forecast, once each."""
    wanted = [p["policy"] for f in forecasts for p in f[method]]
    return [c for c in group if c["policy"] in wanted]


def forecast(replays: dict, oracle_ms: ContextCosts, baseline: dict, in_loop: dict, keep: int | None = 1,
             draft_ms: dict | None = None) -> dict:
    """Per method, its `keep` best policies (None: all) with their predictions under these oracle costs, best
    first: a tree step of q nodes costs oracle_ms's price of it times the method's in-loop factor, plus its
    drafting (times its factor) and loop (`in_loop[method]`, with the spread of its timing where measured); the
    baseline's prefill, one-token forward and loop are `baseline`'s (its first call per prompt is the prefill, which
    yields the first token). With `draft_ms` (replay.draft_costs), the draft's forwards are priced at a projected draft's."""
    any_replay = next(iter(replays.values()))[0]["replay"]
    prompts, tokens = any_replay.prompts, any_replay.tokens
    baseline_ms = (prompts * baseline["prefill"] + (tokens - prompts) * baseline["one_token"]
                   + tokens * baseline["loop"]) / tokens
    predicted = {"baseline": [{"tokens_per_call": 1.0, "ms_per_token": baseline_ms, "speedup": 1.0}]}
    for method, group in replays.items():
        f = in_loop[method]
        predicted[method] = replay.ranked(group, f["oracle"] * oracle_ms, f["loop_ms"], baseline["prefill"],
                                            baseline_ms, f["drafting"], baseline, draft_ms, f.get("timing", 0.0))[:keep]
    return predicted


def best(predicted: dict) -> dict:
    return {method: ranked[0] for method, ranked in predicted.items()}


def with_tree_shapes(measured: dict) -> dict:
    """`measured` with the tree's shapes shared with staged's policies that have no stage below the draft, both ways:
    staged drafts such a shape as the tree method does (the same drafter), so a measurement of one is one of the
    other."""
    if "staged" not in measured or "tree" not in measured:
        return measured
    as_staged = [({**c, "policy": c["policy"] | {"widths": []}}, f) for c, f in measured["tree"] if c["policy"]["depth"] > 1]
    as_tree = [({**c, "policy": {k: v for k, v in c["policy"].items() if k != "widths"}}, f)
               for c, f in measured["staged"] if c["policy"].get("widths") == []]
    return measured | {"staged": measured["staged"] + as_staged, "tree": measured["tree"] + as_tree}


def measured_forecast(measured: dict, oracle_ms: ContextCosts, baseline: dict) -> tuple[dict, dict]:
    """Per method, the best of its policies measured in the loop, each priced with its measurements pooled
    (`repeats.pooled`: their mean, and a timing error no smaller than measurements of one policy lie apart,
    `repeats.spread_between`); and the factors that priced each method's best."""
    groups = {method: repeats.grouped(pairs) for method, pairs in measured.items()}
    priced = lambda method, c, f: forecast({method: [c]}, oracle_ms, baseline, {method: f})
    spread = repeats.spread_between([[priced(method, c, f)[method][0]["speedup"] for f in measurements]
                                     for method, group in groups.items() for c, measurements in group
                                     if len(measurements) > 1])
    predicted: dict[str, dict] = {}
    factors: dict[str, dict] = {}
    for method, group in groups.items():
        pools = [(c, repeats.pooled(measurements, spread)) for c, measurements in group]
        cheapest, factors[method] = min(((priced(method, c, f), f) for c, f in pools),
                                        key=lambda p: p[0][method][0]["ms_per_token"])
        predicted.setdefault("baseline", cheapest["baseline"][0])
        predicted[method] = cheapest[method][0]
    return predicted, factors
