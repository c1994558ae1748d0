"""decode.plan: the tree optimiser against brute force, the replay against real decoding, the plan
file's round trip, and plans measured for something else refused."""
import dataclasses
import itertools
import math
import json
import logging
import shutil
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from decode.errors import InputError
from decode.models.loading import TOKEN_COUNTS

from decode import SpeculativeDecoder
from decode.methods import METHODS
from decode.planning import costs, plan_file, replay, search, shapes
from decode.tree import Tree
from decode.cli import bench, plan, run, serve
from decode.models.cached_lm import Shortlist
from decode.drafting import (ChainDrafter, LookupDrafter, ShapedTreeDrafter, StagedDrafter, StagedShapeDrafter,
                             TreeDrafter)
from decode.models.engine import GPT2Engine
from decode.options import CPU_WIDTHS
from decode.loop import baseline, tree_speculative
from decode.sampling import Sampling, Uniforms
from decode_models import run_models
from decode.models.successors import SuccessorTable


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


def shape_paths(shape: shapes.Shape) -> set[tuple]:
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
def models(tmp_path_factory):
    return run_models(tmp_path_factory.mktemp("plan"))


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
    sequences = [(p.tolist(), baseline(oracle, p, 30, greedy, eos_id=0).tokens) for p in prompts]
    for name, drafter in drafters.items():
        replayed = replay.replay(drafter, sequences)
        calls = nodes = 0
        for p, (_, expected) in zip(prompts, sequences):
            out = tree_speculative(oracle, p, 30, greedy, eos_id=0, drafter=drafter)
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

    def forecast(steps_per_prompt: list[int]) -> dict:  # 24 tokens a prompt in that many steps of 2 nodes
        steps = sum(steps_per_prompt)
        replayed = replay.Replay(prompts=len(steps_per_prompt), steps=steps, tokens=24 * len(steps_per_prompt),
                                 nodes=[2] * steps, accepted=[1] * steps, prompt_tokens=[24] * len(steps_per_prompt),
                                 cached=[128] * steps,
                                 step_prompts=[i for i, n in enumerate(steps_per_prompt) for _ in range(n)])
        return search.forecast({"chain": [{"policy": {}, "replay": replayed}]}, oracle_ms, baseline,
                               {"chain": {"oracle": 1.0, "loop_ms": 0.0, "drafting": 1.0}})["chain"][0]

    alike = forecast([6] * 8)  # each prompt: a 1 ms prefill and 6 steps of 2 ms against 24 ms
    assert alike["speedup"] == pytest.approx(24 / 13) and alike["speedup_interval"] == pytest.approx([24 / 13] * 2)
    mixed = forecast([3, 12, 4, 8, 6, 10, 5, 7])
    low, high = mixed["speedup_interval"]
    assert 24 / 25 < low < mixed["speedup"] < high < 24 / 7  # within the slowest and the fastest prompt's speedups
    assert forecast([3, 12, 4, 8, 6, 10, 5, 7])["speedup_interval"] == [low, high]  # reproducible


def test_a_policy_that_costs_more_in_the_loop_than_its_replay_shows_gives_way_to_one_measured_faster(monkeypatch):
    """The in-loop costs are measured per policy: a method's best policy under the costs of the first one measured is
    measured too, and the plan keeps the faster of the two, each priced with its own costs."""
    replays = {"tree": [{"policy": {"nodes": n}, "drafter": f"drafter {n}",
                         "replay": replay.Replay(prompts=1, steps=steps, tokens=40, drafting_seconds=seconds,
                                                 nodes=[n] * steps, accepted=[40 // steps - 1] * steps,
                                                 cached=[128] * steps, step_prompts=[0] * steps, prompt_tokens=[40])}
                        for n, steps, seconds in ((8, 4, 0.0008), (4, 10, 0.0002))]}  # 0.2 and 0.02 ms a step
    in_loop_drafting_ms = {"drafter 8": 5.0, "drafter 4": 0.3}  # the 8-node tree's drafting is slow in the loop
    measured_drafters = []

    def loop_costs(decoder, drafters, *rest):
        measured_drafters.append(list(drafters.values()))
        return {"baseline": {"prefill": 1.0, "one_token": 1.0, "loop": 0.0}} | {
            name: {"oracle": 1.0, "loop_ms": 0.0, "drafting_ms": in_loop_drafting_ms.get(drafter, 0.0)}
            for name, drafter in drafters.items()}

    monkeypatch.setattr(plan, "loop_costs", loop_costs)
    oracle_ms = costs.ContextCosts.flat(torch.arange(0, 20, dtype=torch.float64) * 0.1)  # q nodes cost q / 10 ms
    measured, baseline_costs = plan.calibrate_in_loop(None, replays, [], None, oracle_ms)
    assert measured_drafters[1:] == [["drafter 8"], ["drafter 4"]]  # after the context drafter's round
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


def test_the_prompts_screened_on_come_from_across_the_calibration_prompts():
    order = plan.spread(list(range(100)), 16)
    assert sorted(order) == list(range(100))
    assert order[:16] == list(range(0, 96, 6))  # evenly spaced, in order, not the first 16
    assert plan.spread(list(range(5)), 16) == list(range(5))


@pytest.fixture
def planned(models, tmp_path, monkeypatch):
    monkeypatch.setattr(costs, "CACHE_DIR", tmp_path / "costs")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"task_id": f"t{i}", "prompt": f"t{i + 2} t{i + 7} t{i + 3}"}) + "\n"
                               for i in range(6)))
    monkeypatch.setattr(search, "BUDGETS", (4, 8, 12))
    monkeypatch.setattr(search, "STAGED_WIDTHS", ((2, 1, 1), (3, 2, 1)))
    args = ["--oracle", str(models["oracle"]), "--draft", str(models["draft"]), "--ngram", str(models["ngram"]),
            "--prompts", str(prompts), "--max-new-tokens", "16", "--widths", "3,2,1"]
    out, replayed, replay_all = tmp_path / "plan.json", [], search.replay_all
    monkeypatch.setattr(search, "replay_all", lambda candidates, *rest: replay_all(replayed.extend(candidates) or candidates, *rest))
    written = plan.main(args + ["--calibration", "3", "--max-budget", "12", "--max-depth", "3", "--draft-vocab", "64",
                                "--out", str(out)])
    return {"args": args, "path": out, "plan": written, "replayed": replayed}


def without(args: list[str], flag: str) -> list[str]:
    """`args` less `flag` and its value."""
    at = args.index(flag)
    return args[:at] + args[at + 2 :]


def test_plan_round_trips_and_decode_run_uses_it(planned, tmp_path, capsys):
    path, args = planned["path"], without(planned["args"], "--widths")  # a typed flag would win over the plan
    on_disk = json.loads(path.read_text())
    assert on_disk["policies"] == planned["plan"]["policies"]
    assert set(on_disk["policies"]) == {m for m, method in METHODS.items() if method.planned}
    options = run.parse(args + ["--plan", str(path)]).options
    assert plan_file.load_plan(path, options) == on_disk["policies"]
    for method, policy in on_disk["policies"].items():
        predicted = on_disk["predicted"][method]
        assert predicted["tokens_per_call"] >= 1 and predicted["speedup"] > 0
        dec = SpeculativeDecoder(run.parse(args + ["--plan", str(path), "--method", method]).options)
        base = SpeculativeDecoder(run.parse(args + ["--method", "baseline"]).options)
        assert dec.generate("t3 t9", max_new_tokens=16).token_ids == base.generate("t3 t9", max_new_tokens=16).token_ids, method
        drafter, shortlist = dec.decoder.drafter, dec.decoder.draft and dec.decoder.draft.shortlist
        assert (len(shortlist) if shortlist else 0) == policy.get("draft_vocab", 0), method
        if method == "speculative":
            assert dec.options.k == policy["k"]
        elif "parents" in policy:  # a planned shape: the tree's, or staged's with the trigram guessing ahead
            assert isinstance(drafter, ShapedTreeDrafter) and drafter.parents == policy["parents"]
            if method == "staged":  # no trigram guesses: the draft's tree alone, drafted as the tree method does
                assert isinstance(drafter, StagedShapeDrafter) == bool(policy["widths"])
                assert not policy["widths"] or drafter.trigram.widths == policy["widths"]
            drafter.reset()  # sampling: the shape's children are draws, each node's q recorded
            drawn = drafter.propose([3, 9], 8, Sampling(1.0), Uniforms(torch.Generator().manual_seed(1)))
            counts = lambda children: sorted(map(len, children))
            assert counts(drawn.children) == counts([[c for c, p in enumerate(policy["parents"]) if p == n]
                                                     for n in range(len(policy["parents"]))])
            assert set(drawn.child_dists) == {n for n, children in enumerate(drawn.children) if children}
        elif method == "lookup":
            assert drafter.length == policy["tokens"]
        else:
            assert drafter.budget == policy["budget"] and drafter.trigram.widths == policy["widths"]
    assert run.parse(args + ["--plan", str(path), "--no-plan"]).options.plan is None
    capsys.readouterr()
    run.main(args + ["--plan", str(path), "--method", "speculative", "--limit", "1"])
    policy = on_disk["policies"]["speculative"]
    assert f"speculative with k {policy['k']}, draft_vocab {policy['draft_vocab']}, draft_dtype float32" in capsys.readouterr().err


def test_staged_on_the_trees_planned_shape_decodes_and_benches_as_planned(planned, tmp_path, capsys):
    """A staged policy on a planned shape (with the trigram guessing one level ahead): decode.run drafts that shape
    with the trigram, also under typed --widths deeper than the shape (the guesses stop where it does), the
    baseline's tokens come out, and decode.bench reports the tree it drafted."""
    plan_json = json.loads(planned["path"].read_text())
    shape = {"parents": [-1, 0, 0, 1], "ranks": [0, 0, 1, 0], "expected": 1.5, "nodes": 4, "depth": 2}
    plan_json["policies"]["staged"] = shape | {"widths": [1]}
    path = tmp_path / "shaped.json"
    path.write_text(json.dumps(plan_json))
    args = without(planned["args"], "--widths") + ["--plan", str(path)]
    base = SpeculativeDecoder(run.parse(args + ["--method", "baseline"]).options)
    for typed, widths in (([], [1]), (["--widths", "3,2,1"], [3, 2, 1])):
        dec = SpeculativeDecoder(run.parse(args + ["--method", "staged"] + typed).options)
        assert isinstance(dec.decoder.drafter, StagedShapeDrafter) and dec.decoder.drafter.parents == shape["parents"]
        assert dec.decoder.drafter.trigram.widths == widths
        assert dec.generate("t3 t9", max_new_tokens=16).token_ids == base.generate("t3 t9", max_new_tokens=16).token_ids
    capsys.readouterr()
    result = bench.main(args + ["--methods", "baseline,staged", "--limit", "2", "--out", str(tmp_path / "b.json")])
    nodes = len(shape["parents"])
    assert result["settings"]["tree_sizes"]["staged"]["nodes"] == nodes
    assert f"a fixed shape of {nodes} nodes" in capsys.readouterr().out
    assert result["summary"]["staged"]["same_output"]["identical"] == 2


def test_staged_on_a_planned_shape_without_guesses_drafts_the_trees_shape_and_is_exact(planned, tmp_path, capsys):
    """A staged policy whose shape has no trigram guesses (the plan's choice where they cost more than they save)
    drafts exactly what the tree method drafts on that shape: the same trees, the baseline's tokens; decode.bench
    says so."""
    plan_json = json.loads(planned["path"].read_text())
    shape = {"parents": [-1, 0, 0, 1], "ranks": [0, 0, 1, 0], "expected": 1.5, "nodes": 4, "depth": 2}
    plan_json["policies"]["staged"] = shape | {"widths": []}
    plan_json["policies"]["tree"] = shape
    path = tmp_path / "unguessed.json"
    path.write_text(json.dumps(plan_json))
    args = without(planned["args"], "--widths") + ["--plan", str(path)]
    decoded = {}
    for method in ("baseline", "tree", "staged"):
        dec = SpeculativeDecoder(run.parse(args + ["--method", method]).options)
        decoded[method] = dec.generate("t3 t9", max_new_tokens=16).token_ids
        if method != "baseline":
            assert type(dec.decoder.drafter) is ShapedTreeDrafter and dec.decoder.drafter.parents == shape["parents"]
            dec.decoder.drafter.reset()
            decoded[method, "tree"] = dec.decoder.drafter.propose([3, 9], 8, Sampling(1.0),
                                                                  Uniforms(torch.Generator().manual_seed(1))).tokens
    assert decoded["staged"] == decoded["tree"] == decoded["baseline"]
    assert decoded["staged", "tree"] == decoded["tree", "tree"]
    typed = SpeculativeDecoder(run.parse(args + ["--method", "staged", "--budget", "7"]).options).decoder
    assert typed.drafter.budget == 7 and typed.drafter.trigram.widths == list(CPU_WIDTHS)  # the flags' tree, its widths
    capsys.readouterr()
    result = bench.main(args + ["--methods", "baseline,tree,staged", "--limit", "2", "--out", str(tmp_path / "b.json")])
    assert "staged: no stage below the draft, a fixed shape of 4 nodes" in capsys.readouterr().out
    assert result["summary"]["staged"]["same_output"]["identical"] == 2
    with pytest.raises(SystemExit) as exit_info:  # typed, a staged tree needs the trigram's widths
        SpeculativeDecoder(run.parse(without(planned["args"], "--widths") + ["--method", "staged", "--widths", ""]).options)
    assert exit_info.value.code == 2


def planned_tree(drafter, policy: dict) -> bool:
    """Whether a staged drafter drafts the plan's tree: its shape, or its budget."""
    return drafter.parents == policy["parents"] if "parents" in policy else drafter.budget == policy["budget"]


def test_a_flag_typed_wins_over_the_plan_which_fills_in_the_rest(planned, models, tmp_path, capsys):
    path, args = planned["path"], without(planned["args"], "--widths") + ["--plan", str(planned["path"])]
    policies = json.loads(path.read_text())["policies"]
    decoder = lambda *flags: SpeculativeDecoder(run.parse(args + list(flags)).options).decoder
    staged = decoder("--method", "staged", "--budget", "7")  # a plan's staged shape without widths: the default ones
    planned_widths = policies["staged"]["widths"]
    assert staged.drafter.budget == 7 and staged.drafter.trigram.widths == (planned_widths or list(CPU_WIDTHS))
    assert (len(staged.draft.shortlist) if staged.draft.shortlist else 0) == policies["staged"].get("draft_vocab", 0)
    assert "budget" not in staged.options.policy and staged.options.policy.get("widths") == (planned_widths or None)
    whole = decoder("--method", "staged", "--draft-vocab", "0")
    assert whole.draft.shortlist is None and planned_tree(whole.drafter, policies["staged"])
    assert decoder("--method", "speculative", "--k", "2").options.k == 2
    tree = decoder("--method", "tree", "--budget", "5")  # a planned tree stands for every tree flag: the flags' tree
    assert isinstance(tree.drafter, TreeDrafter) and tree.drafter.budget == 5 and "parents" not in tree.options.policy
    typed_all = decoder("--method", "lookup", "--lookup-tokens", "3")
    assert typed_all.options.policy is None and typed_all.drafter.length == 3
    base = SpeculativeDecoder(run.parse(args + ["--method", "baseline"]).options)
    assert SpeculativeDecoder(run.parse(args + ["--method", "staged", "--budget", "7"]).options).generate("t3 t9", max_new_tokens=16).token_ids \
        == base.generate("t3 t9", max_new_tokens=16).token_ids
    capsys.readouterr()
    run.main(args + ["--method", "staged", "--budget", "7", "--limit", "1"])
    said = next(line for line in capsys.readouterr().err.splitlines() if line.startswith("plan "))
    assert (f"widths {planned_widths}" in said) == bool(planned_widths) and "budget" not in said
    assert "a flag you type wins" in said
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    for part in ("oracle", "draft", "ngram"):
        (run_dir / part).symlink_to(models[part])
    (run_dir / "plan.json").write_text(path.read_text())
    from_run = SpeculativeDecoder.from_run(run_dir, method="staged", budget=7).decoder
    assert from_run.drafter.budget == 7 and from_run.drafter.trigram.widths == (planned_widths or list(CPU_WIDTHS))
    assert planned_tree(SpeculativeDecoder.from_run(run_dir, method="staged").decoder.drafter, policies["staged"])


def test_plan_weighs_each_draft_methods_best_policy_with_the_draft_shortlist_and_decoding_follows_its_choice(planned):
    weighed = {}
    for method, policy, drafter in planned["replayed"]:
        weighed.setdefault(method, set()).add((policy.get("draft_vocab"), policy.get("draft_dtype")))
        model = getattr(getattr(drafter, "draft", None), "model", None)
        assert (len(model.shortlist) if model and model.shortlist else 0) == policy.get("draft_vocab", 0)
        assert model is None or model.dtype == torch.float32
    drafts = {(0, "float32"), (64, "float32")}  # a float32 plan weighs no other dtype
    assert weighed == {"speculative": drafts, "tree": drafts, "staged": drafts, "ngram": {(None, None)}, "lookup": {(None, None)}}
    path, args = planned["path"], planned["args"]
    shortlisted = json.loads(path.read_text())
    for method in ("speculative", "tree", "staged"):
        shortlisted["policies"][method] |= {"draft_vocab": 64, "draft_dtype": "bfloat16"}
    path.write_text(json.dumps(shortlisted))
    expected = SpeculativeDecoder(run.parse(args + ["--method", "baseline"]).options).generate("t3 t9", max_new_tokens=16).token_ids
    for method in ("speculative", "tree", "staged"):
        dec = SpeculativeDecoder(run.parse(args + ["--plan", str(path), "--method", method]).options)
        assert len(dec.decoder.draft.shortlist) == 64 and dec.decoder.draft.dtype == torch.bfloat16, method
        assert dec.decoder.oracle.dtype == torch.float32 and dec.generate("t3 t9", max_new_tokens=16).token_ids == expected, method
    whole = SpeculativeDecoder(run.parse(args + ["--plan", str(path), "--method", "staged", "--no-plan", "--draft-vocab", "0"]).options)
    assert whole.decoder.draft.shortlist is None and whole.decoder.draft.dtype == torch.float32


def test_beside_a_bfloat16_oracle_the_plan_weighs_the_draft_in_float32_too(models):
    options = run.parse(["--oracle", str(models["oracle"]), "--draft", str(models["draft"]), "--prompt", "t1",
                         "--dtype", "bfloat16"]).options
    variants = plan.draft_variants([64], options, 97)
    assert set(variants) == {(0, "float32"), (64, "bfloat16"), (64, "float32")}  # (0, bfloat16) is the plan's own draft
    for (size, dtype), draft in variants.items():
        assert (len(draft.shortlist) if draft.shortlist else 0) == size and draft.dtype == getattr(torch, dtype)
    chosen = plan.draft_variants([], dataclasses.replace(options, draft_dtype="float32"), 97)
    assert set(chosen) == set()  # a float32 draft (--draft-dtype) has no other dtype to weigh


def test_on_a_gpu_the_plan_weighs_no_other_draft_dtype(models, monkeypatch):
    monkeypatch.setattr(plan, "load_draft", lambda options, vocab_size: (options.draft_vocab, options.draft_dtype))
    options = run.parse(["--oracle", str(models["oracle"]), "--draft", str(models["draft"]), "--prompt", "t1",
                         "--dtype", "bfloat16"]).options
    assert set(plan.draft_variants([64], dataclasses.replace(options, device="cuda"), 97)) == {(64, "bfloat16")}
    assert set(plan.draft_variants([64], options, 97)) == {(0, "float32"), (64, "bfloat16"), (64, "float32")}


def test_plan_weighs_the_largest_power_of_two_up_to_half_the_vocabulary_by_default(models, tmp_path, capsys):
    options = run.parse(["--oracle", str(models["oracle"]), "--draft", str(models["draft"]), "--prompt", "t1"]).options
    assert plan.shortlist_sizes(None, options, 8192) == [4096]
    assert plan.shortlist_sizes(None, options, 50257) == [16384]
    assert plan.shortlist_sizes(None, options, 97) == []  # too small a vocabulary to shortlist
    assert plan.shortlist_sizes([0, 64, 96, 97, 200], options, 97) == [64, 96]
    no_counts = tmp_path / "draft"
    no_counts.mkdir()
    assert plan.shortlist_sizes(None, dataclasses.replace(options, draft=no_counts), 8192) == []
    assert TOKEN_COUNTS in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        plan.parse(["--oracle", str(models["oracle"]), "--prompt", "t1", "--out", str(tmp_path / "p.json"), "--draft-vocab", "4096,10"])
    assert exit_info.value.code == 2 and "at least 64" in capsys.readouterr().err
    for f in models["draft"].iterdir():  # a draft trained before the counts were saved
        if f.name != TOKEN_COUNTS:
            (no_counts / f.name).symlink_to(f)
    with pytest.raises(SystemExit) as exit_info:  # asked for a shortlist it cannot make: before any calibration
        plan.main(["--oracle", str(models["oracle"]), "--draft", str(no_counts), "--ngram", str(models["ngram"]),
                   "--prompt", "t1", "--out", str(tmp_path / "p.json"), "--draft-vocab", "64"])
    err = capsys.readouterr()
    assert exit_info.value.code == 2 and TOKEN_COUNTS in err.err and "calibrating" not in err.out
    assert not (tmp_path / "p.json").exists()


def test_a_plan_for_other_models_or_settings_is_refused_in_one_line(planned, models, capsys):
    path, args = planned["path"], planned["args"]
    with pytest.raises(SystemExit) as exit_info:
        run.main(args + ["--plan", str(path), "--method", "staged", "--dtype", "bfloat16", "--limit", "1"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "dtype" in err and "decode.plan" in err and "--no-plan" in err
    weights = models["draft"] / "model.safetensors"
    original = weights.read_bytes()
    weights.write_bytes(original[:-1] + bytes([original[-1] ^ 1]))  # the draft was retrained: one weight differs
    try:
        with pytest.raises(SystemExit):
            run.main(args + ["--plan", str(path), "--method", "speculative", "--limit", "1"])
        assert "draft changed" in capsys.readouterr().err
    finally:
        weights.write_bytes(original)
    path.write_text("{}")
    with pytest.raises(SystemExit):
        run.main(args + ["--plan", str(path), "--method", "lookup", "--limit", "1"])
    assert "not a plan" in capsys.readouterr().err


def test_a_copied_run_keeps_its_plan_and_a_damaged_copy_names_the_damage(planned, models, tmp_path, capsys):
    copy = tmp_path / "copy"
    for part in ("oracle", "draft", "ngram"):
        shutil.copytree(models[part], copy / part)  # new paths, new modification times, the same bytes
    (copy / "plan.json").write_text(planned["path"].read_text())
    prompts = planned["args"][planned["args"].index("--prompts") + 1]
    assert run.parse(["--run", str(copy), "--prompts", prompts]).options.plan == copy / "plan.json"
    weights = copy / "draft" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])  # a copy cut short
    with pytest.raises(SystemExit) as exit_info:
        run.main(["--run", str(copy), "--prompts", prompts, "--method", "speculative", "--limit", "1"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert exit_info.value.code == 2 and f"{weights} is damaged" in err and "plan" not in err
    shutil.copy(models["draft"] / "model.safetensors", weights)
    shutil.rmtree(copy / "ngram")
    with pytest.raises(SystemExit):
        run.main(["--run", str(copy), "--plan", str(copy / "plan.json"), "--method", "ngram", "--prompts", prompts])
    assert f"the ngram at {copy / 'ngram'}, which does not exist" in capsys.readouterr().err


def test_a_run_plan_for_another_dtype_is_set_aside_with_a_note(planned, models, tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    for part in ("oracle", "draft", "ngram"):
        (run_dir / part).symlink_to(models[part])
    (run_dir / "plan.json").write_text(planned["path"].read_text())
    prompts = planned["args"][planned["args"].index("--prompts") + 1]
    same = run.parse(["--run", str(run_dir), "--prompts", prompts])
    assert same.options.plan == run_dir / "plan.json" and not capsys.readouterr().err
    other = run.parse(["--run", str(run_dir), "--prompts", prompts, "--dtype", "bfloat16"])
    note = capsys.readouterr().err
    assert other.options.plan is None and "dtype 'float32'" in note and "--dtype bfloat16" in note
    assert SpeculativeDecoder.from_run(run_dir, method="lookup").options.plan == run_dir / "plan.json"
    assert SpeculativeDecoder.from_run(run_dir, method="lookup", dtype="bfloat16").options.plan is None


def test_a_plan_measured_with_cuda_graphs_is_used_only_with_them(planned, models, tmp_path, capsys, monkeypatch):
    path, args = planned["path"], planned["args"]
    on_cpu = run.parse(args + ["--plan", str(path)]).options  # graphs by default, which change nothing on a CPU
    assert on_cpu.cuda_graphs and plan_file.identity(on_cpu) == planned["plan"]["identity"]
    assert plan_file.load_plan(path, on_cpu) == planned["plan"]["policies"]
    monkeypatch.setattr(plan_file, "device_name", lambda device: planned["plan"]["identity"]["device"])
    on_gpu = dataclasses.replace(on_cpu, device="cuda")  # as a GPU would see it
    assert plan_file.identity(on_gpu) == planned["plan"]["identity"] | {"cuda_graphs": True}
    with pytest.raises(InputError, match=r"cuda_graphs False \(now True\)") as refused:
        plan_file.load_plan(path, on_gpu)
    assert "python -m decode.plan --run" in str(refused.value) and "--no-cuda-graphs" not in str(refused.value)
    without = run.parse(args + ["--plan", str(path), "--no-cuda-graphs"]).options
    assert plan_file.load_plan(path, dataclasses.replace(without, device="cuda")) == planned["plan"]["policies"]
    assert "--no-cuda-graphs" in plan_file.replan_command(path.parent, without)
    older = json.loads(path.read_text())
    del older["identity"]["cuda_graphs"]  # a plan written before the setting
    older["identity"]["draft_vocab"] = 0  # nor does a shortlist recorded there by an older decode.plan count
    path.write_text(json.dumps(older))
    assert plan_file.load_plan(path, on_cpu) == planned["plan"]["policies"]
    graphed = json.loads(path.read_text())
    graphed["identity"]["cuda_graphs"] = True  # the plan a GPU run writes (with graphs, the default)
    path.write_text(json.dumps(graphed))
    with pytest.raises(InputError, match=r"cuda_graphs True \(now False\)"):
        plan_file.load_plan(path, run.parse(args + ["--plan", str(path)]).options)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    for part in ("oracle", "draft", "ngram"):
        (run_dir / part).symlink_to(models[part])
    (run_dir / "plan.json").write_text(path.read_text())
    prompts = args[args.index("--prompts") + 1]
    assert run.parse(["--run", str(run_dir), "--prompts", prompts]).options.plan is None
    assert "cuda_graphs True" in capsys.readouterr().err


def test_tree_methods_without_a_plan_say_what_they_draft_on_this_device(planned, models, tmp_path, capsys, caplog):
    """Without a plan on a CPU, staged drafts the draft's chain (the shape plans choose there) and the tree method a
    tree sized for a CPU; both say so, with the command that plans them. A tree sized by hand stays as typed."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    for part in ("oracle", "draft", "ngram"):
        (run_dir / part).symlink_to(models[part])
    prompts = ["--prompts", planned["args"][planned["args"].index("--prompts") + 1]]
    options = run.parse(["--run", str(run_dir), *prompts]).options
    chain = list(range(-1, plan_file.CPU_CHAIN))
    assert options.plan is None and options.tree_shape.parents == chain and options.widths == []
    note = capsys.readouterr().err
    assert "no plan for this setting in" in note and f"the draft's chain of {plan_file.CPU_CHAIN} tokens" in note
    assert f"python -m decode.plan --run {run_dir}" in note
    drafter = SpeculativeDecoder(options).decoder.drafter
    assert type(drafter) is ShapedTreeDrafter and drafter.is_chain and drafter.parents == chain
    tree = run.parse(["--run", str(run_dir), *prompts, "--method", "tree"]).options
    assert (tree.tree_shape, tree.budget) == (None, 12)  # a CPU's, not the paper's
    assert "sized for this device (budget 12, widths 3,2,1)" in capsys.readouterr().err
    typed = run.parse(["--run", str(run_dir), *prompts, "--budget", "16"]).options
    assert (typed.tree_shape, typed.budget, typed.widths) == (None, 16, [3, 2, 1])
    for quiet in (["--widths", "4,2,1", "--budget", "16"], ["--budget", "36"], ["--paper-tree"], ["--method", "lookup"],
                  ["--no-plan"]):
        run.parse(["--run", str(run_dir), *prompts, *quiet])
        assert "note:" not in capsys.readouterr().err
    with caplog.at_level(logging.INFO, logger="decode"):  # the library logs it; the commands print it
        SpeculativeDecoder.from_run(run_dir, method="staged")
    assert "the draft's chain of" in caplog.text


def test_plan_refuses_to_replace_a_file_it_did_not_write_and_a_bad_projection(planned, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        plan.main(planned["args"] + ["--out", str(planned["path"])])
    assert exit_info.value.code == 2 and "--overwrite" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        plan.main(planned["args"] + ["--out", str(tmp_path / "x.json"), "--project-oracle", "12,100,50"])
    assert exit_info.value.code == 2 and "multiple of 64" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


def test_sampled_acceptance_is_certain_for_the_oracle_itself_and_falls_with_depth(models):
    oracle, draft = GPT2Engine.load(models["oracle"]), GPT2Engine.load(models["draft"])
    sampling, prompt = Sampling(1.0, top_k=20), [3, 9, 4]
    continuation = baseline(oracle, torch.tensor(prompt), 20, sampling, None, generator=torch.Generator().manual_seed(0)).tokens
    same = shapes.overlaps(oracle, GPT2Engine.load(models["oracle"]), sampling, prompt, continuation)
    assert same == pytest.approx([1.0] * len(continuation))
    other = shapes.overlaps(oracle, draft, sampling, prompt, continuation)
    assert all(0 < a < 1 for a in other)
    chain = shapes.chain_acceptance([other], 4)
    assert chain[0] == pytest.approx(sum(other) / len(other)) and chain == sorted(chain, reverse=True)


def test_a_sampling_setting_is_planned_by_decoding_into_its_own_file_which_runs_read_at_that_setting(planned, models,
                                                                                                     tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    for part in ("oracle", "draft", "ngram"):
        (run_dir / part).symlink_to(models[part])
    prompts = ["--prompts", planned["args"][planned["args"].index("--prompts") + 1]]
    decoded = []
    sampled_replay = replay.sampled
    monkeypatch.setattr(replay, "sampled", lambda drafter, *rest: decoded.append(drafter) or sampled_replay(drafter, *rest))
    setting = ["--temperature", "1", "--top-k", "20"]
    written = plan.main(["--run", str(run_dir), *prompts, "--max-new-tokens", "16", "--calibration", "2",
                         "--max-budget", "8", "--max-depth", "2", "--draft-vocab", "0", *setting])
    path = run_dir / "plan-t1-k20-p1.json"
    assert json.loads(path.read_text())["sampling"] == written["sampling"] == "T=1.0 top-k 20 top-p 1.0"
    sampled = written["acceptance"]["sampled"]
    assert sampled["setting"] == "T=1.0 top-k 20 top-p 1.0" and len(sampled["draft_chain"]) == 2
    assert 0 < sampled["draft_chain"][1] <= sampled["draft_chain"][0] < 1
    assert decoded and not (run_dir / "plan.json").exists()  # every policy was decoded for real, none replayed greedily
    branches = {d.draft_children for d in decoded if isinstance(d, StagedDrafter)}
    assert {1, 2} <= branches  # staged's trees tried as chains of draws and as two draws a node
    options = run.parse(["--run", str(run_dir), *prompts, *setting, "--method", "staged"]).options
    assert options.plan == path and options.policy == written["policies"]["staged"]  # a shape or budget and widths:
    # which one the plan chose follows this machine's timing


def test_paper_tree_is_one_flag_away_and_refused_beside_a_typed_tree(models):
    args = ["--oracle", str(models["oracle"]), "--draft", str(models["draft"]), "--ngram", str(models["ngram"]),
            "--prompt", "t1"]
    assert run.parse(args).options.tree_shape.parents == list(range(-1, plan_file.CPU_CHAIN))  # a CPU's default
    paper = run.parse(args + ["--paper-tree"])
    assert (paper.options.budget, paper.options.widths) == (36, [12, 7, 4, 1, 1, 1]) and {"budget", "widths"} <= paper.flags.given
    with pytest.raises(SystemExit):
        run.parse(args + ["--paper-tree", "--budget", "16"])


def test_auto_dtype_is_the_plans_on_this_device_else_the_devices_native_one(planned, monkeypatch, tmp_path):
    from decode.models import precision

    monkeypatch.delenv(precision.PINNED)
    monkeypatch.setattr(precision, "cpu_features", lambda: "AVX-512 BF16")
    assert precision.auto_dtype("cpu")[0] == "bfloat16"
    monkeypatch.setattr(precision, "cpu_features", lambda: "AMX, AVX-512 BF16")
    assert precision.auto_dtype("cpu")[0] == "bfloat16"
    monkeypatch.setattr(precision, "cpu_features", lambda: "AVX2")
    dtype, why = precision.auto_dtype("cpu")
    assert dtype == "float32" and "no bfloat16 instructions" in why
    plan = json.loads(planned["path"].read_text())  # planned here, in float32
    assert precision.auto_dtype("cpu", planned["path"])[0] == plan["identity"]["dtype"] == "float32"
    monkeypatch.setattr(precision, "cpu_features", lambda: "AVX-512 BF16")
    assert precision.auto_dtype("cpu", planned["path"]) == ("float32", f"{planned['path']} was planned in it on this device")
    elsewhere = tmp_path / "other-plan.json"
    elsewhere.write_text(json.dumps({**plan, "identity": {**plan["identity"], "device": "another machine"}}))
    assert precision.auto_dtype("cpu", elsewhere)[0] == "bfloat16"  # a plan measured on another device says nothing here
    monkeypatch.setenv(precision.PINNED, "bfloat16")
    assert precision.auto_dtype("cpu", planned["path"])[0] == "bfloat16"


def test_each_setting_takes_its_own_plan_else_the_nearest_and_says_which(planned, models, tmp_path, capsys, caplog):
    """Which plan a sampling setting decodes with: its own; else the nearest planned setting's, said in a line; else
    none (the method's defaults). On a run with a greedy plan only, with a top-k plan only, with both, with none."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    for part in ("oracle", "draft", "ngram"):
        (run_dir / part).symlink_to(models[part])
    plan_json = json.loads(planned["path"].read_text())
    greedy, top_k, top_k_far = Sampling(), Sampling(1.0, 20), Sampling(1.0, 50)
    prompts = ["--prompts", planned["args"][planned["args"].index("--prompts") + 1]]
    plans = {greedy: run_dir / "plan.json", top_k_far: run_dir / "plan-t1-k50-p1.json"}

    def chosen(sampling: Sampling) -> Path | None:
        flags = ["--temperature", str(sampling.temperature), "--top-k", str(sampling.top_k)] if not sampling.greedy else []
        from_command = run.parse(["--run", str(run_dir), *prompts, "--method", "staged", *flags]).options.plan
        from_library = SpeculativeDecoder.from_run(run_dir, method="staged").options_for(sampling).plan
        assert from_command == from_library
        return from_command

    assert chosen(greedy) is None and chosen(top_k) is None  # no plan at all: the defaults
    plans[greedy].write_text(json.dumps(plan_json))
    capsys.readouterr()
    assert chosen(top_k) == plans[greedy]  # a greedy plan only: the sampled setting borrows it, and says so
    assert f"using {plans[greedy]} (planned for greedy, the nearest planned setting to T=1.0 top-k 20 top-p 1.0" in \
        capsys.readouterr().err
    plans[top_k_far].write_text(json.dumps(plan_json | {"sampling": top_k_far.describe()}))
    with caplog.at_level(logging.INFO, logger="decode"):
        assert chosen(top_k) == plans[top_k_far] and chosen(greedy) == plans[greedy]  # both: each its nearest
    assert f"T=1.0 top-k 20 top-p 1.0 decodes with the plan {plans[top_k_far]} (planned for T=1.0 top-k 50" in caplog.text
    plans[greedy].unlink()
    assert chosen(greedy) == plans[top_k_far] and chosen(Sampling(1.0, 50)) == plans[top_k_far]  # a top-k plan only
    elsewhere = json.loads(plans[top_k_far].read_text())
    plans[top_k_far].write_text(json.dumps(elsewhere | {"identity": elsewhere["identity"] | {"device": "another"}}))
    assert chosen(top_k) is None  # a plan for another device is never borrowed


def test_each_call_decodes_with_its_sampling_settings_plan_over_the_same_models(planned, models, tmp_path):
    """A run with plans for greedy decoding and for top-k 20: from_run's decoder (and the server's) decodes each call
    with its setting's plan, a setting without one with the nearest setting's, every decoder over the models loaded
    once; a keyword wins over every plan, plan=None turns them all off and a plan named is used for every call."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    for part in ("oracle", "draft", "ngram"):
        (run_dir / part).symlink_to(models[part])
    plan_json = json.loads(planned["path"].read_text())
    greedy, top_k = {"widths": [2, 1], "budget": 6, "draft_vocab": 0}, {"widths": [1, 1], "budget": 3, "draft_vocab": 64}
    for name, policy in (("plan.json", greedy), ("plan-t1-k20-p1.json", top_k)):
        (run_dir / name).write_text(json.dumps(plan_json | {"policies": plan_json["policies"] | {"staged": policy}}))
    dec = SpeculativeDecoder.from_run(run_dir, method="staged")
    sampled, other = Sampling(1.0, 20), Sampling(0.7)
    assert dec.decoder.drafter.budget == 6 and dec.decoder_for(Sampling()) is dec.decoder
    assert dec.options_for(other).plan == run_dir / "plan.json"  # no plan of its own: the nearest, greedy's
    result = dec.generate("t3 t9", max_new_tokens=16, do_sample=True, temperature=1.0, top_k=20, seed=3)
    assert len(result.token_ids) == 16 and {plan for plan, _ in dec.decoders} == {run_dir / "plan.json",
                                                                                   run_dir / "plan-t1-k20-p1.json"}
    own = dec.decoder_for(sampled)
    assert (own.drafter.budget, own.drafter.trigram.widths, len(own.draft.shortlist)) == (3, [1, 1], 64)
    assert own.oracle is dec.decoder.oracle and dec.decoder.draft.shortlist is None  # one oracle; each draft layer
    assert dec.generate("t3 t9", max_new_tokens=16, do_sample=True, temperature=1.0, top_k=20, seed=3).token_ids == \
        result.token_ids and dec.decoder_for(sampled) is own
    typed = SpeculativeDecoder.from_run(run_dir, method="staged", budget=5)
    assert (typed.decoder_for(sampled).drafter.budget, typed.decoder_for(sampled).drafter.trigram.widths) == (5, [1, 1])
    unplanned = SpeculativeDecoder.from_run(run_dir, method="staged", plan=None)  # each setting: the CPU's default
    assert unplanned.options.plan is None and unplanned.decoder.drafter.parents == list(range(-1, plan_file.CPU_CHAIN))
    assert unplanned.decoder_for(sampled).drafter.parents == list(range(-1, plan_file.CPU_SAMPLED_CHAIN))
    assert unplanned.decoder_for(Sampling(0.5, 20)) is unplanned.decoder_for(sampled)  # the same drafting: one decoder
    named = SpeculativeDecoder.from_run(run_dir, method="staged", plan=run_dir / "plan.json")  # one plan for every call
    assert named.decoder_for(sampled) is named.decoder and named.decoder.drafter.budget == 6
    served = serve.parse(["--run", str(run_dir), "--method", "staged"])
    assert served.plans.options(sampled).policy == top_k and served.options.policy == greedy
    assert serve.parse(["--run", str(run_dir), "--method", "staged", "--no-plan"]).plans.plan_for(sampled) == (None, [])
