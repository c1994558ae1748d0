"""decode.planning: the tree optimiser against brute force, the replay against real decoding, the forecast and its
interval, and the search's choice between policies."""
import itertools
import math
import random

import numpy as np
import pytest
import torch

from decode.cli import plan
from decode.drafting import ChainDrafter, LookupDrafter, ShapedTreeDrafter, StagedDrafter
from decode.loop import baseline, tree_speculative
from decode.models.engine import GPT2Engine
from decode.models.loading import TOKEN_COUNTS
from decode.models.successors import SuccessorTable
from decode.planning import costs, in_loop, kinds, repeats, replay, search, shapes
from decode.sampling import Sampling
from decode.shortlist import Shortlist
from decode.tree import Shape, Tree


def rank_trees(nodes: int, depth: int, width: int):
    """Every tree of ranks with `nodes` nodes below the root and at most `depth` levels, as a set of
    rank paths (a node is the tuple of ranks from the root)."""
    def below(prefix, m, level):
        if m == 0:
            yield ()
            return
        if level == depth:
            return
        for sizes in itertools.product(range(m + 1), repeat=width):  # nodes per rank's subtree
            if sum(sizes) != m:
                continue
            parts = [[()] if s == 0 else [((prefix + (k,)),) + sub for sub in below(prefix + (k,), s - 1, level + 1)]
                     for k, s in enumerate(sizes)]
            for combo in itertools.product(*parts):
                yield tuple(node for part in combo for node in part)
    yield from below((), nodes, 0)


def value(tree_paths, p) -> float:
    return sum(torch.tensor([p[d][k] for d, k in enumerate(path)]).prod().item() for path in tree_paths)


def shape_paths(shape: Shape) -> set[tuple]:
    paths = {0: ()}
    for node, (parent, rank) in enumerate(zip(shape.parents[1:], shape.ranks[1:]), 1):
        paths[node] = paths[parent] + (rank,)
    return set(paths.values()) - {()}


@pytest.mark.parametrize("seed", range(4))
def test_best_shapes_are_the_optimum_found_by_brute_force(seed):
    rng = random.Random(seed)
    depth, width = 3, 3
    p = []
    for _ in range(depth):  # rates per depth that need not fall with rank
        row = [rng.random() for _ in range(width)]
        p.append([x / sum(row) * rng.uniform(0.3, 1.0) for x in row])
    found = shapes.best_shapes(p, 7, depth)
    for n in range(1, 8):
        best = max(value(t, p) for t in rank_trees(n - 1, depth, width))
        assert found[n].expected == pytest.approx(best)
        assert len(found[n].parents) == n and len(shape_paths(found[n])) == n - 1
        assert value(shape_paths(found[n]), p) == pytest.approx(best)  # the tree returned is worth its value
        assert max((len(path) for path in shape_paths(found[n])), default=0) <= depth


def test_best_shapes_know_when_no_tree_fits_and_prefer_a_chain_when_the_top_rank_is_sure():
    best = shapes.best_shapes([[0.5, 0.3]], 4, 1)
    assert best[3].ranks == [0, 0, 1] and best[4] is None  # one level of two ranks holds 2 nodes
    chain = shapes.best_shapes([[0.9, 0.05]] * 4, 5, 4)[5]
    assert chain.parents == [-1, 0, 1, 2, 3] and chain.ranks == [0] * 5
    assert chain.expected == pytest.approx(0.9 + 0.81 + 0.729 + 0.6561)


def test_acceptance_counts_ranks_where_a_tree_can_reach():
    # ranks of five tokens; width 2: rank 2 is out of every tree, so nothing below it is reachable
    p = shapes.acceptance([[0, 1, 2, 0, 0]], width=2, depth=2)
    assert p[0] == pytest.approx([3 / 5, 1 / 5])
    # depth 2 is reached from starts 0, 1, 3 (the token above it within rank 2): ranks 1, 2, 0
    assert p[1] == pytest.approx([1 / 3, 1 / 3])


@pytest.fixture(scope="module")
def models(plan_run_models):
    return plan_run_models


@pytest.mark.parametrize("shortlisted", [False, True])
def test_replay_counts_the_oracle_calls_real_greedy_decoding_makes(models, shortlisted):
    shortlist = Shortlist.most_frequent(np.load(models["draft"] / TOKEN_COUNTS), 64) if shortlisted else None
    oracle, draft = GPT2Engine.load(models["oracle"]), GPT2Engine.load(models["draft"], shortlist=shortlist)
    table = SuccessorTable.load(models["ngram"] / "successors.npz")
    shape = shapes.best_shapes([[0.6, 0.2, 0.1]] * 3, 8, 3)[8]
    greedy = Sampling()
    drafters = {"chain": ChainDrafter(draft, 3), "shape": ShapedTreeDrafter(draft, shape.parents, shape.ranks),
                "staged": StagedDrafter(draft, table, 10, [3, 2, 1], context=LookupDrafter(4), depth=4),
                "lookup": LookupDrafter(5)}
    rng = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 97, (int(torch.randint(2, 9, (), generator=rng)),), generator=rng) for _ in range(6)]
    sequences = [(p.tolist(), baseline(oracle, p, 30, greedy, stop_ids={0}).tokens) for p in prompts]
    for name, drafter in drafters.items():
        replayed = replay.replay(drafter, sequences)
        calls = nodes = 0
        for p, (_, expected) in zip(prompts, sequences):
            out = tree_speculative(oracle, p, 30, greedy, stop_ids={0}, drafter=drafter)
            assert out.tokens == expected, name  # the shaped tree is exact too
            calls, nodes = calls + out.oracle_calls - (len(p) > 1), nodes + out.oracle_nodes
        assert replayed.steps == calls and sum(replayed.nodes) == nodes, name
        assert replayed.tokens == sum(len(c) for _, c in sequences)
    if shortlisted:  # the planner's ranks: among the shortlist's tokens, and past all of them for a token off it
        whole = GPT2Engine.load(models["draft"])
        prompt, continuation = sequences[0]
        logits = whole.extend(torch.tensor(prompt + continuation[:-1]))[len(prompt) - 1 :][:, torch.from_numpy(shortlist.tokens)]
        target = torch.tensor([float(row[shortlist.column[t]]) if shortlist.column[t] >= 0 else math.inf
                               for row, t in zip(logits, continuation)])
        assert shapes.ranks(draft, prompt, continuation) == (logits > target[:, None]).sum(1).where(
            target < math.inf, torch.tensor(64)).tolist()


def test_a_replay_records_each_draft_forward_which_a_projection_prices_at_another_drafts_costs(models):
    """Every draft forward of a replay is recorded as (rows, cached positions): a chain drafter's first one reads the
    whole prompt onto an empty cache, and each later one starts where the one before ended or where a step's accepted
    tokens left the cache; a drafter without a draft model records none. Priced at another draft's costs, the
    recorded forwards replace their measured time and nothing else."""
    oracle, draft = GPT2Engine.load(models["oracle"]), GPT2Engine.load(models["draft"])
    prompt = [5, 9, 2, 7]
    sequences = [(prompt, baseline(oracle, torch.tensor(prompt), 24, Sampling(), stop_ids={0}).tokens)]
    chained = replay.replay(ChainDrafter(draft, 3), sequences)
    assert chained.draft_forwards[0] == (len(prompt), 0)
    assert len(chained.draft_forwards) == 3 * chained.steps  # three forwards a step down the chain
    assert all(cached > 0 for _, cached in chained.draft_forwards[1:])
    assert 0 < chained.draft_seconds < chained.drafting_seconds
    assert replay.replay(LookupDrafter(4), sequences).draft_forwards == []
    rows = torch.arange(0, 4096, dtype=torch.float64)  # a forward of q rows costs q ms, after any cached length
    own = replay.predict(chained, costs.ContextCosts.flat(rows), loop_ms=0.0, prefill_ms=0.0)
    priced = replay.predict(chained, costs.ContextCosts.flat(rows), loop_ms=0.0, prefill_ms=0.0,
                            draft_ms=costs.ContextCosts.flat(rows))
    bookkeeping = 1e3 * (chained.drafting_seconds - chained.draft_seconds)
    assert priced["drafting_ms_per_call"] == pytest.approx(
        (bookkeeping + sum(q for q, _ in chained.draft_forwards)) / chained.steps)
    assert priced["oracle_ms_per_call"] == own["oracle_ms_per_call"]


def test_predict_adds_the_prefill_and_per_step_the_oracle_the_drafting_and_the_loop():
    replayed = replay.Replay(prompts=1, steps=2, tokens=6, drafting_seconds=0.003, nodes=[4, 8], accepted=[2, 2],
                             cached=[100, 103], step_prompts=[0, 0], prompt_tokens=[6])
    oracle_ms = costs.ContextCosts.flat(torch.arange(0, 10, dtype=torch.float64))  # q nodes cost q ms
    got = replay.predict(replayed, oracle_ms, loop_ms=0.5, prefill_ms=2.0)
    assert got["tokens_per_call"] == 2  # the prefill is an oracle call, as decode.bench counts it
    assert got["ms_per_token"] == pytest.approx((2 + 12 + 3 + 1) / 6)
    assert replayed.accepted_by_depth(3) == [1.0, 1.0, 0.0]


def test_a_forward_is_priced_at_its_own_cached_length():
    """Costs measured after 128 and 256 cached positions: a step is priced between them by its cached length, past
    the longer one on the same line (attention over the cache grows linearly), before the shorter one as after it."""
    q = torch.arange(0, 10, dtype=torch.float64)
    oracle_ms = costs.ContextCosts({128: q, 256: 2 * q})  # q ms after 128 cached positions, 2q ms after 256
    assert oracle_ms.at([4, 4, 4, 4, 8], [0, 128, 192, 256, 384]).tolist() == [4, 4, 6, 8, 24]
    replayed = replay.Replay(prompts=1, steps=2, tokens=6, nodes=[4, 8], accepted=[2, 2], cached=[100, 384],
                             step_prompts=[0, 0], prompt_tokens=[6])
    assert replay.predict(replayed, oracle_ms, loop_ms=0.0, prefill_ms=0.0)["oracle_ms_per_call"] == (4 + 24) / 2
    assert (3 * oracle_ms).at([8], [384]).tolist() == [72]  # an in-loop factor scales every length alike
    assert replay.replay(FixedChain(), [([1, 2, 3], [4, 5, 6, 7])]).cached == [2, 5]  # all but each step's root


class FixedChain:
    """A drafter that proposes the next two tokens of the continuation 4, 5, 6, 7 (steps accept two, then one)."""

    def forget(self):
        pass

    def reset(self):
        pass

    def accept(self, path):
        pass

    def propose(self, tokens, max_depth, sampling, generator):
        tree = Tree.rooted(tokens[-1])
        tree.add_path([t for t in (4, 5, 6, 7) if t > tokens[-1]][:2])
        return tree


def test_the_forecast_interval_spans_the_calibration_prompts_speedups():
    """On a clock where q nodes cost q ms and the baseline 1 ms a token: prompts alike give an interval that is the
    point; prompts whose speedups differ give one that holds the point and lies within their extremes."""
    baseline = {"prefill": 1.0, "one_token": 1.0, "loop": 0.0}
    oracle_ms = costs.ContextCosts.flat(torch.arange(0, 20, dtype=torch.float64))

    def forecast(steps_per_prompt: list[int], timing: float = 0.0) -> dict:  # 24 tokens a prompt, steps of 2 nodes
        steps = sum(steps_per_prompt)
        replayed = replay.Replay(prompts=len(steps_per_prompt), steps=steps, tokens=24 * len(steps_per_prompt),
                                 nodes=[2] * steps, accepted=[1] * steps, prompt_tokens=[24] * len(steps_per_prompt),
                                 cached=[128] * steps,
                                 step_prompts=[i for i, n in enumerate(steps_per_prompt) for _ in range(n)])
        return search.forecast({"chain": [{"policy": {}, "replay": replayed}]}, oracle_ms, baseline,
                               {"chain": {"oracle": 1.0, "loop_ms": 0.0, "drafting": 1.0, "timing": timing}})["chain"][0]

    alike = forecast([6] * 8)  # each prompt: a 1 ms prefill and 6 steps of 2 ms against 24 ms
    assert alike["speedup"] == pytest.approx(24 / 13) and alike["speedup_interval"] == pytest.approx([24 / 13] * 2)
    steps = [3, 12, 4, 8, 6, 10, 5, 7]
    mixed = forecast(steps)
    low, high = mixed["speedup_interval"]
    assert 24 / 25 < low < mixed["speedup"] < high < 24 / 7  # within the slowest and the fastest prompt's speedups
    # a benchmark's prompts are another draw than the calibration's: the interval is about sqrt(2) as wide as the
    # calibration set's own spread (its speedup over resamplings of its prompts)
    rng = np.random.default_rng(1)
    prompt_ms = 1 + 2 * np.array(steps, dtype=float)
    own = 24 * len(steps) / prompt_ms[rng.integers(0, len(steps), (20000, len(steps)))].sum(1)
    own_width = np.log(np.quantile(own, 0.95) / np.quantile(own, 0.05))
    assert np.log(high / low) / own_width == pytest.approx(math.sqrt(2), rel=0.1)
    assert forecast([3, 12, 4, 8, 6, 10, 5, 7])["speedup_interval"] == [low, high]  # reproducible
    # a measurement whose timing may be 5% off widens it by that spread's central 90% (1.645 standard deviations)
    timed = forecast([6] * 8, timing=0.05)
    assert timed["speedup"] == alike["speedup"]
    assert timed["speedup_interval"] == pytest.approx([24 / 13 * math.exp(-1.645 * 0.05), 24 / 13 * math.exp(1.645 * 0.05)],
                                                      rel=0.01)


def test_the_timing_spread_is_the_passes_relative_spread_of_the_speedup_counted_for_two_measurements():
    same = [(1.0, 100), (2.0, 200), (1.5, 150)]  # the baseline, a ms a token every pass
    assert in_loop.timing_spread(same, [(0.5, 100), (1.0, 200), (0.75, 150)]) == 0.0  # always twice as fast
    speedups = np.array([2.0, 2.5, 1.5, 2.0])
    method = [(b / s, t) for (b, t), s in zip(same + [(1.0, 100)], speedups)]
    assert in_loop.timing_spread(same + [(1.0, 100)], method) == pytest.approx(
        speedups.std(ddof=1) / speedups.mean() * math.sqrt(2 / 4))
    assert in_loop.timing_spread(same[:1], method[:1]) == 0.0  # one pass: nothing to tell


@pytest.mark.parametrize("slowdown", [1.0, 1.3])
def test_a_policy_that_costs_more_in_the_loop_than_its_replay_shows_gives_way_to_one_measured_faster(
                                                                                                     slowdown):
    """The in-loop costs are measured per policy: a method's best policy under the costs of the first one measured is
    measured too, and the plan keeps the faster of the two, each priced with its own costs. A round run while the
    machine was `slowdown` times slower (its baseline too) counts at the last round's speed."""
    replays = {"tree": [{"policy": {"nodes": n}, "drafter": f"drafter {n}",
                         "replay": replay.Replay(prompts=1, steps=steps, tokens=40, drafting_seconds=seconds,
                                                 nodes=[n] * steps, accepted=[40 // steps - 1] * steps,
                                                 cached=[128] * steps, step_prompts=[0] * steps, prompt_tokens=[40])}
                        for n, steps, seconds in ((8, 4, 0.0008), (4, 10, 0.0002))]}  # 0.2 and 0.02 ms a step
    in_loop_drafting_ms = {8: 5.0, 4: 0.3}  # the 8-node tree's drafting is slow in the loop
    measured_policies = []

    def measure(policies):
        measured_policies.append(list(policies.values()))
        slow = slowdown if len(measured_policies) == 2 else 1.0  # the 8-node tree's round
        return {"baseline": {"prefill": slow, "one_token": slow, "loop": 0.0}} | {
            name: {"oracle": slow, "loop_ms": 0.0, "drafting_ms": slow * in_loop_drafting_ms.get(policy.get("nodes"), 0.0),
                   "timing": 0.02}
            for name, (_, policy) in policies.items()}

    oracle_ms = costs.ContextCosts.flat(torch.arange(0, 20, dtype=torch.float64) * 0.1)  # q nodes cost q / 10 ms
    measured, baseline_costs = in_loop.calibrate_in_loop(measure, measure, replays, oracle_ms)
    # the context drafter standing for every method, then each policy under its own method's name, then the best again
    assert measured_policies == [[("lookup", {})], [("tree", {"nodes": 8})], [("tree", {"nodes": 4})],
                                 [("tree", {"nodes": 4})]]
    assert [f for _, f in measured["tree"]] == [
        pytest.approx({"oracle": 1.0, "loop_ms": 0.0, "drafting": 5.0 / 0.2, "timing": 0.02}),
        *[pytest.approx({"oracle": 1.0, "loop_ms": 0.0, "drafting": 0.3 / 0.02, "timing": 0.02})] * 2]
    predicted, factors = search.measured_forecast(measured, oracle_ms, baseline_costs)
    assert predicted["tree"]["policy"] == {"nodes": 4}
    assert factors["tree"]["drafting"] == pytest.approx(0.3 / 0.02)  # its own: 0.3 ms in the loop, 0.02 replayed
    assert predicted["tree"]["ms_per_token"] == pytest.approx((1.0 + 10 * (0.4 + 0.3)) / 40)
    assert predicted["baseline"]["ms_per_token"] == pytest.approx(1.0)


def test_staged_may_take_a_shape_measured_for_the_tree_as_its_own_with_no_stage_below_the_draft():
    shape = {"parents": [-1, 0, 1], "ranks": [0, 0, 0], "nodes": 3, "depth": 2}
    candidate = lambda policy, steps: {"policy": policy, "drafter": None, "replay": replay.Replay(
        prompts=1, steps=steps, tokens=40, drafting_seconds=0.0, nodes=[3] * steps, accepted=[1] * steps,
        cached=[128] * steps, step_prompts=[0] * steps, prompt_tokens=[40])}
    factors = {"oracle": 1.0, "loop_ms": 0.0, "drafting": 1.0}
    measured = {"tree": [(candidate(shape, 10), factors)],
                "staged": [(candidate({"widths": [2, 1], "budget": 8}, 20), factors)]}
    baseline_costs = {"prefill": 1.0, "one_token": 1.0, "loop": 0.0}
    predicted, _ = search.measured_forecast(search.with_tree_shapes(measured), costs.ContextCosts.flat(torch.arange(0, 20.0)),
                                            baseline_costs)
    assert predicted["staged"]["policy"] == shape | {"widths": []}
    assert predicted["staged"]["ms_per_token"] == predicted["tree"]["ms_per_token"]


def test_measurements_of_one_policy_are_pooled_and_how_far_they_lie_apart_widens_its_interval():
    """The tree and staged with no stage below the draft draft a shape alike, so each one's measurement of it counts
    for both: each method's forecast prices it at the two measurements' mean, not at the luckier, and its timing error
    is how far a benchmark's measurement may lie from that mean, from how far the two lie apart."""
    shape = {"parents": [-1, 0, 1], "ranks": [0, 0, 0], "nodes": 3, "depth": 2}
    candidate = lambda policy, drafting_seconds: {"policy": policy, "drafter": None, "replay": replay.Replay(
        prompts=1, steps=10, tokens=40, drafting_seconds=drafting_seconds, nodes=[3] * 10, accepted=[3] * 10,
        cached=[128] * 10, step_prompts=[0] * 10, prompt_tokens=[40])}
    tree = (candidate(shape, 0.001), {"oracle": 1.0, "loop_ms": 0.0, "drafting": 1.0, "timing": 0.01})
    # staged's replay timed its drafting at 0.2 ms a step, the tree's at 0.1: both measured 0.1 ms in the loop
    staged = (candidate(shape | {"widths": []}, 0.002), {"oracle": 1.5, "loop_ms": 0.2, "drafting": 0.5, "timing": 0.01})
    oracle_ms, baseline_costs = costs.ContextCosts.flat(torch.arange(0, 20.0)), {"prefill": 1.0, "one_token": 1.0, "loop": 0.0}
    predicted, factors = search.measured_forecast(search.with_tree_shapes({"tree": [tree], "staged": [staged]}),
                                                  oracle_ms, baseline_costs)
    assert predicted["staged"]["policy"] == shape | {"widths": []} and predicted["tree"]["policy"] == shape
    assert predicted["staged"]["ms_per_token"] == pytest.approx(predicted["tree"]["ms_per_token"])
    assert factors["tree"] == pytest.approx({"oracle": 1.25, "loop_ms": 0.1, "drafting": 1.0, "timing": factors["tree"]["timing"]})
    assert factors["staged"]["drafting"] == pytest.approx(0.5)  # against staged's own replay
    alone = [search.forecast({"tree": [c]}, oracle_ms, baseline_costs, {"tree": f})["tree"][0]["speedup"] for c, f in (tree, staged)]
    spread = abs(math.log(alone[0] / alone[1])) / math.sqrt(2)  # the standard deviation of two, about their mean
    assert factors["tree"]["timing"] == pytest.approx(spread * math.sqrt(1 + 1 / 2)) and spread > 0.01
    assert factors["staged"]["timing"] == pytest.approx(factors["tree"]["timing"])
    # measured once, and nothing measured twice: its own timing error
    assert repeats.pooled([tree[1]], repeats.spread_between([[2.0]])) == tree[1]


def test_the_prompts_screened_on_come_from_across_the_calibration_prompts():
    order = plan.spread(list(range(100)), 16)
    assert sorted(order) == list(range(100))
    assert order[:16] == list(range(0, 96, 6))  # evenly spaced, in order, not the first 16
    assert plan.spread(list(range(5)), 16) == list(range(5))


def prediction(policy: dict, ms: float, tokens: float = 4.0) -> dict:
    return {"policy": policy, "ms_per_token": ms, "tokens_per_call": tokens, "oracle_ms_per_call": 2.0 * ms,
            "drafting_ms_per_call": 0.1, "mean_nodes": float(len(policy.get("parents", [0] * 6))), "speedup": 1.0 / ms}


def test_each_policy_is_a_chain_a_branching_tree_or_a_trigram_stage_and_each_kind_shows_its_fastest():
    chain = {"parents": [-1, 0, 1, 2], "ranks": [0, 0, 0, 0]}
    branching = {"parents": [-1, 0, 0, 1], "ranks": [0, 0, 1, 0]}
    assert kinds.kind_of("speculative", {"k": 5}) == "chain"
    assert kinds.kind_of("tree", chain) == "chain" and kinds.kind_of("staged", chain | {"widths": []}) == "chain"
    assert kinds.kind_of("tree", branching) == "branching tree"
    assert kinds.kind_of("staged", branching | {"widths": [1]}) == "trigram stage"
    assert kinds.kind_of("staged", {"widths": [3, 2, 1], "budget": 24}) == "trigram stage"
    assert kinds.kind_of("lookup", {"tokens": 4}) is None and kinds.kind_of("ngram", {"widths": [3], "budget": 8}) is None
    ranked = {"speculative": [prediction({"k": 4}, 0.30), prediction({"k": 6}, 0.25)],
              "tree": [prediction(chain, 0.28), prediction(branching, 0.40)],
              "staged": [prediction({"widths": [3, 2, 1], "budget": 24}, 0.35), prediction(branching | {"widths": []}, 0.38)],
              "lookup": [prediction({"tokens": 4}, 0.10)]}
    best = kinds.best_of_each_kind(ranked)
    assert list(best) == ["chain", "branching tree", "trigram stage"]  # lookup drafts no tree of the draft's
    assert best["chain"] == ("speculative", ranked["speculative"][1])
    assert best["branching tree"] == ("staged", ranked["staged"][1])
    rows = kinds.kinds_table(ranked, one_row_ms=0.5)
    assert rows[0]["oracle_forwards_per_call"] == pytest.approx(2 * 0.25 / 0.5) and rows[0]["speedup"] == pytest.approx(4.0)
    # a method's choice, measured in a decoding loop, stands for its kind in that method; its other kinds stay
    chosen = {"tree": prediction(chain, 0.29)}
    shown = kinds.with_choices(ranked, chosen)
    assert shown["tree"] == [chosen["tree"], ranked["tree"][1]] and shown["staged"] == ranked["staged"]
    assert kinds.best_of_each_kind({"tree": shown["tree"]})["chain"] == ("tree", chosen["tree"])


def test_a_load_prices_each_requests_tree_as_its_share_of_one_forward_over_all_of_them():
    from decode.planning.concurrency import shared_baseline, shared_costs

    table = {1: 1.0, 2: 1.0, 4: 1.2, 8: 2.0, 16: 4.0}  # flat to 2 rows, then linear
    shared = shared_costs({128: table, 512: {q: 2 * ms for q, ms in table.items()}}, 8, 2)
    assert shared.at([1, 2, 4, 8], [128] * 4).tolist() == pytest.approx([0.5, 0.6, 1.0, 2.0])  # c(2q) / 2
    assert shared.at([4], [512]).item() == pytest.approx(2.0)  # each cached length's own curve
    assert shared_costs({128: table}, 8, 1).at([3], [128]).item() == pytest.approx(1.1)  # one request: its own curve
    base = {"prefill": 5.0, "one_token": 2.0, "loop": 0.1}
    assert shared_baseline(base, 1.0, 0.5) == {"prefill": 5.0, "one_token": 1.0, "loop": 0.1}
