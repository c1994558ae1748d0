"""decode.plan and the plans the other commands read: the plan file's round trip, a typed flag over the plan, each
sampling setting's own plan, and plans measured for something else refused."""
import dataclasses
import json
import logging
import os
import signal
from pathlib import Path

import pytest
import torch
from plan_fixtures import without

from decode import SpeculativeDecoder, plan_file
from decode.cli import bench, plan, report, run, serve
from decode.devices import CPU, CPU_CHAIN
from decode.drafting import ShapedTreeDrafter, StagedDrafter, StagedShapeDrafter, TreeDrafter
from decode.loop import baseline
from decode.methods import METHODS
from decode.models.engine import GPT2Engine
from decode.models.loading import TOKEN_COUNTS
from decode.models.quantize_model import quantize_checkpoint
from decode.models.quantized import FORMATS
from decode.planning import in_loop, kinds, planner, replay, shapes
from decode.provenance import provenance
from decode.sampling import Sampling, Uniforms


@pytest.fixture(scope="module")
def models(plan_run_models):
    return plan_run_models


def test_plan_round_trips_and_decode_run_uses_it(planned, tmp_path, capsys):
    path, args = planned["path"], without(planned["args"], "--widths")  # a typed flag would win over the plan
    on_disk = json.loads(path.read_text())
    assert on_disk["policies"] == planned["plan"]["policies"]
    assert set(on_disk["policies"]) == {m for m, method in METHODS.items() if method.planned}
    assert {"commit", "torch", "transformers"} <= on_disk["measured_with"].keys()
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
    assert (f"speculative with k {policy['k']}, draft_vocab {policy['draft_vocab']}, draft_dtype {policy['draft_dtype']}"
            in capsys.readouterr().err)


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
    assert typed.drafter.budget == 7 and typed.drafter.trigram.widths == list(CPU.widths)  # the flags' tree, its widths
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
    assert staged.drafter.budget == 7 and staged.drafter.trigram.widths == (planned_widths or list(CPU.widths))
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
    assert from_run.drafter.budget == 7 and from_run.drafter.trigram.widths == (planned_widths or list(CPU.widths))
    assert planned_tree(SpeculativeDecoder.from_run(run_dir, method="staged").decoder.drafter, policies["staged"])


def test_plan_weighs_each_draft_methods_best_policy_with_the_draft_shortlist_and_decoding_follows_its_choice(planned):
    weighed = {}
    for method, policy, drafter in planned["replayed"]:
        weighed.setdefault(method, set()).add((policy.get("draft_vocab"), policy.get("draft_dtype")))
        model = getattr(getattr(drafter, "draft", None), "model", None)
        assert (len(model.shortlist) if model and model.shortlist else 0) == policy.get("draft_vocab", 0)
        assert model is None or model.dtype == torch.float32
    # a float32 plan weighs no other dtype, and the draft quantized as it loads
    drafts = {(n, p) for n in (0, 64) for p in ("float32", "q8_0", "q4_0")}
    assert weighed == {"speculative": drafts, "tree": drafts, "staged": drafts, "ngram": {(None, None)}, "lookup": {(None, None)}}
    path, args = planned["path"], planned["args"]
    expected = SpeculativeDecoder(run.parse(args + ["--method", "baseline"]).options).generate("t3 t9", max_new_tokens=16).token_ids
    for precision, dtype, quantization in (("bfloat16", torch.bfloat16, None), ("q8_0", torch.float32, FORMATS["q8_0"])):
        shortlisted = json.loads(path.read_text())
        for method in ("speculative", "tree", "staged"):
            shortlisted["policies"][method] |= {"draft_vocab": 64, "draft_dtype": precision}
        path.write_text(json.dumps(shortlisted))
        for method in ("speculative", "tree", "staged"):
            dec = SpeculativeDecoder(run.parse(args + ["--plan", str(path), "--method", method]).options)
            draft = dec.decoder.draft
            assert len(draft.shortlist) == 64 and draft.dtype == dtype and draft.runtime.quantization is quantization
            assert dec.decoder.oracle.dtype == torch.float32 and dec.generate("t3 t9", max_new_tokens=16).token_ids == expected, method
    whole = SpeculativeDecoder(run.parse(args + ["--plan", str(path), "--method", "staged", "--no-plan", "--draft-vocab", "0"]).options)
    assert whole.decoder.draft.shortlist is None and whole.decoder.draft.dtype == torch.float32


def test_a_projection_prices_a_larger_oracle_and_draft_and_says_what_it_measured_and_what_it_borrowed(planned, tmp_path,
                                                                                                      capsys):
    written = plan.main(planned["args"] + ["--calibration", "3", "--max-budget", "12", "--max-depth", "3",
                                           "--draft-vocab", "64", "--out", str(tmp_path / "p.json"),
                                           "--project-oracle", "2,128,500", "--project-draft", "1,64,500",
                                           "--concurrency", "1,3"])
    projection = written["projection"]
    assert set(projection["concurrency"]) == {"3"} and set(written["concurrency"]) == {"3"}
    assert set(projection["concurrency"]["3"]["policies"]) == set(projection["predicted"]) - {"baseline"}
    assert projection["shape"] == [2, 128, 500] and projection["draft_shape"] == [1, 64, 500]
    assert set(projection["draft_one_row_ms"]) == {f"{n} in {p}" for n in ("every token", "64 tokens")
                                                   for p in ("float32", "q8_0", "q4_0")}
    assert projection["sources"]["measured here, on random weights"] == ["the 2,128,500 oracle's forward costs",
                                                                        "the 1,64,500 draft's forward costs"]
    assert set(projection["predicted"]) == {"baseline", "speculative", "tree", "staged", "ngram", "lookup"}
    out = capsys.readouterr().out
    assert "PROJECTION (not a measurement)" in out and "with a 1,64,500 draft (1 x 64, vocabulary 500)" in out
    assert "borrowed from the trained pair: the acceptance (tokens per call)" in out
    assert "PROJECTION for the 2,128,500 oracle at 3 requests in flight" in out
    assert json.loads((tmp_path / "p.json").read_text())["projection"]["sources"] == projection["sources"]
    markdown = report.plan_markdown(json.loads((tmp_path / "p.json").read_text()))
    staged = projection["concurrency"]["3"]["predicted"]["staged"]
    assert "code not recorded" not in markdown and projection["commit"] == provenance()["commit"]
    assert f"| 3 | staged | {staged['tokens_per_call']:.2f} | {staged['ms_per_token']:.1f} | {staged['speedup']:.2f}x |" in markdown


def test_the_plan_shows_each_kind_of_tree_at_its_best_replayed_on_every_calibration_prompt(planned, capsys):
    made = planned["plan"]
    screened = {kinds.kind_of(method, policy) for method, policy, _ in planned["replayed"]} - {None}
    rows = made["kinds"]
    assert [r["kind"] for r in rows] == [kind for kind in kinds.KINDS if kind in screened] and len(rows) == 3
    finalists = [(method, policy) for method, policy, _ in planned["finalists"]]
    for r in rows:  # each kind's best among the screened policies went on to the finalists
        assert (r["method"], r["policy"]) in finalists and kinds.kind_of(r["method"], r["policy"]) == r["kind"]
        assert r["oracle_forwards_per_call"] > 0 and r["speedup"] > 0
    kinds_part = report.plan_markdown(json.loads(planned["path"].read_text())).split("\n\n- ")[0]  # then the levels'
    table = [line.split(" | ") for line in kinds_part.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert [(cells[0].lstrip("| "), cells[1]) for cells in table] == [(r["kind"], r["method"]) for r in rows]
    assert [cells[6] for cells in table] == [f"{r['speedup']:.2f}x" for r in rows]


def test_the_bench_notes_prompts_much_longer_than_the_plans_calibration_prompts(planned, tmp_path, capsys):
    calibrated = planned["plan"]["calibration"]["prompt_tokens"]
    assert 2 <= calibrated <= 4  # the fixture's prompts: three words, a token each or two
    args = planned["args"] + ["--plan", str(planned["path"]), "--methods", "baseline,staged", "--limit", "2"]
    for words, noted in ((3, False), (12, True)):
        prompts = tmp_path / f"{words}.jsonl"
        prompts.write_text("".join(json.dumps({"task_id": f"t{i}", "prompt": " ".join(f"t{(i + j) % 9 + 2}" for j in range(words))})
                                   + "\n" for i in range(2)))
        capsys.readouterr()
        bench.main(without(args, "--prompts") + ["--prompts", str(prompts)])
        out = capsys.readouterr().out
        assert ("and the plan's calibration prompts" in out) == noted, out
        assert not noted or "the speedup on longer prompts is lower than the forecast" in out


def test_beside_a_bfloat16_oracle_the_plan_weighs_the_draft_in_float32_and_quantized_as_it_loads(models, tmp_path,
                                                                                                     capsys):
    options = run.parse(["--oracle", str(models["oracle"]), "--draft", str(models["draft"]), "--prompt", "t1",
                         "--dtype", "bfloat16"]).options
    variants = planner.draft_variants([64], options, 97)
    # (0, bfloat16) is the plan's own draft
    assert set(variants) == {(n, p) for n in (0, 64) for p in ("bfloat16", "float32", "q8_0", "q4_0")} - {(0, "bfloat16")}
    for (size, precision), draft in variants.items():
        assert (len(draft.shortlist) if draft.shortlist else 0) == size
        quantized = precision in FORMATS  # a draft quantized as it loads computes in the oracle's dtype
        assert draft.dtype == (torch.bfloat16 if quantized else getattr(torch, precision))
        assert draft.runtime.quantization is (FORMATS[precision] if quantized else None)
    chosen = planner.draft_variants([], dataclasses.replace(options, draft_dtype="float32"), 97)
    assert set(chosen) == {(0, "q8_0"), (0, "q4_0")}  # a float32 draft (--draft-dtype) has no other dtype to weigh
    quantize_checkpoint(models["draft"], tmp_path / "draft-q8_0", FORMATS["q8_0"])
    capsys.readouterr()
    stored = planner.draft_variants([], dataclasses.replace(options, draft=tmp_path / "draft-q8_0"), 97)
    assert set(stored) == {(0, "float32")}  # a quantized draft is not quantized again
    assert "note: not weighing the draft in q8_0: " in capsys.readouterr().err


@pytest.mark.processes
def test_ctrl_c_is_the_planners_to_answer_and_ends_its_measuring_process_quietly(models, capfd, interruptible):
    options = run.parse(["--oracle", str(models["oracle"]), "--draft", str(models["draft"]), "--ngram",
                         str(models["ngram"]), "--prompt", "t1"]).options
    with pytest.raises(KeyboardInterrupt), in_loop.FreshProcess(options, [], None, None) as fresh:
        (worker,) = fresh.workers
        os.kill(worker.pid, signal.SIGINT)  # Ctrl-C reaches the whole process group: while the worker starts,
        fresh.started.result(timeout=120)
        os.kill(worker.pid, signal.SIGINT)  # and once it has loaded the models
        os.kill(os.getpid(), signal.SIGINT)
    worker.join(timeout=30)
    assert not worker.is_alive()
    err = capfd.readouterr().err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err


def test_on_a_gpu_the_plan_weighs_no_other_draft_dtype(models, monkeypatch):
    monkeypatch.setattr(planner, "load_draft", lambda options, vocab_size: (options.draft_vocab, options.draft_dtype))
    options = run.parse(["--oracle", str(models["oracle"]), "--draft", str(models["draft"]), "--prompt", "t1",
                         "--dtype", "bfloat16"]).options
    assert set(planner.draft_variants([64], dataclasses.replace(options, device="cuda"), 97)) == {(64, "bfloat16")}
    assert set(planner.draft_variants([64], options, 97)) == {(n, p) for n in (0, 64) for p in (
        "bfloat16", "float32", "q8_0", "q4_0")} - {(0, "bfloat16")}


def test_plan_weighs_the_largest_power_of_two_up_to_half_the_vocabulary_by_default(models, tmp_path, capsys):
    options = run.parse(["--oracle", str(models["oracle"]), "--draft", str(models["draft"]), "--prompt", "t1"]).options
    assert planner.shortlist_sizes(None, options, 8192) == [4096]
    assert planner.shortlist_sizes(None, options, 50257) == [16384]
    assert planner.shortlist_sizes(None, options, 97) == []  # too small a vocabulary to shortlist
    assert planner.shortlist_sizes([0, 64, 96, 97, 200], options, 97) == [64, 96]
    no_counts = tmp_path / "draft"
    no_counts.mkdir()
    assert planner.shortlist_sizes(None, dataclasses.replace(options, draft=no_counts), 8192) == []
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


def test_sampled_acceptance_is_certain_for_the_oracle_itself_and_falls_with_depth(models):
    oracle, draft = GPT2Engine.load(models["oracle"]), GPT2Engine.load(models["draft"])
    sampling, prompt = Sampling(1.0, top_k=20), [3, 9, 4]
    continuation = baseline(oracle, torch.tensor(prompt), 20, sampling, (), generator=torch.Generator().manual_seed(0)).tokens
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
    assert run.parse(args).options.tree_shape.parents == list(range(-1, CPU_CHAIN[0]))  # a CPU's default
    paper = run.parse(args + ["--paper-tree"])
    assert (paper.options.budget, paper.options.widths) == (36, [12, 7, 4, 1, 1, 1]) and {"budget", "widths"} <= paper.flags.given
    with pytest.raises(SystemExit):
        run.parse(args + ["--paper-tree", "--budget", "16"])


def test_auto_dtype_is_the_plans_on_this_device_else_the_devices_native_one(planned, monkeypatch, tmp_path):
    from decode import devices
    from decode.models import precision

    monkeypatch.delenv(precision.PINNED)
    monkeypatch.setattr(devices, "cpu_features", lambda: "AVX-512 BF16")
    assert precision.auto_dtype("cpu")[0] == "bfloat16"
    monkeypatch.setattr(devices, "cpu_features", lambda: "AMX, AVX-512 BF16")
    assert precision.auto_dtype("cpu")[0] == "bfloat16"
    monkeypatch.setattr(devices, "cpu_features", lambda: "AVX2")
    dtype, why = precision.auto_dtype("cpu")
    assert dtype == "float32" and "no bfloat16 instructions" in why
    plan = json.loads(planned["path"].read_text())  # planned here, in float32
    assert precision.auto_dtype("cpu", planned["path"])[0] == plan["identity"]["dtype"] == "float32"
    monkeypatch.setattr(devices, "cpu_features", lambda: "AVX-512 BF16")
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
    note = capsys.readouterr().err
    assert f"decodes with the plan {plans[greedy]} (planned for greedy, the nearest planned setting to T=1.0 top-k 20 " \
           f"top-p 1.0)" in note and "python -m decode.plan --run" in note and "--temperature 1 --top-k 20" in note
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
    assert unplanned.options.plan is None and unplanned.decoder.drafter.parents == list(range(-1, CPU_CHAIN[0]))
    assert unplanned.decoder_for(sampled).drafter.parents == list(range(-1, CPU_CHAIN[1]))
    assert unplanned.decoder_for(Sampling(0.5, 20)) is unplanned.decoder_for(sampled)  # the same drafting: one decoder
    named = SpeculativeDecoder.from_run(run_dir, method="staged", plan=run_dir / "plan.json")  # one plan for every call
    assert named.decoder_for(sampled) is named.decoder and named.decoder.drafter.budget == 6
    served = serve.parse(["--run", str(run_dir), "--method", "staged"])
    assert served.plans.options(sampled).policy == top_k and served.options.policy == greedy
    assert serve.parse(["--run", str(run_dir), "--method", "staged", "--no-plan"]).plans.plan_for(sampled) == (None, [])


def test_a_plan_for_a_load_chooses_a_policy_per_level_and_a_batch_decodes_with_the_largest_level_it_reaches(
        planned, models, tmp_path, capsys):
    """decode.plan --concurrency records each method's policy for each load; a greedy request in a batch of N takes
    the largest level up to N, its output still the oracle's; a sampled one keeps its setting's policy at any load."""
    written = planned["plan"]
    assert set(written["concurrency"]) == {"4"}
    assert set(written["concurrency"]["4"]["policies"]) == set(written["policies"])
    plan_json = json.loads(planned["path"].read_text())
    staged = plan_json["concurrency"]["4"]["predicted"]["staged"]
    assert (f"| 4 | staged | {staged['tokens_per_call']:.2f} | {staged['ms_per_token']:.3f} | {staged['speedup']:.2f}x |"
            in report.plan_markdown(plan_json))
    loaded = {"widths": [1], "budget": 3, "draft_vocab": 0}  # a policy of its own at 2 in flight, to tell it apart
    plan_json["concurrency"] = {"2": {"policies": plan_json["policies"] | {"staged": loaded}}}
    path = tmp_path / "loads.json"
    path.write_text(json.dumps(plan_json))
    options = dataclasses.replace(run.parse(planned["args"] + ["--no-plan"]).options, method="staged")
    assert [plan_file.load_plan(path, options, n)["staged"] for n in (1, 2, 3)] == [plan_json["policies"]["staged"],
                                                                                    loaded, loaded]
    dec = SpeculativeDecoder.from_run(None, oracle=models["oracle"], draft=models["draft"], ngram=models["ngram"],
                                      method="staged", plan=path)
    prompts = ["t3 t9 t4", "t5 t2", "t7 t7 t1"]
    alone = [dec.generate(p, max_new_tokens=12).token_ids for p in prompts]
    assert len(dec.decoders) == 1
    together = dec.generate_batch(prompts, max_new_tokens=12)
    assert [r.token_ids for r in together] == alone and len(dec.decoders) == 2  # the batch's: the load's policy
    assert dec.decoder_for(Sampling(), 3).drafter.budget == 3 and dec.decoder_for(Sampling(), 3) is not dec.decoder
    assert dec.options_for(Sampling(1.0, 20), 3) is dec.options_for(Sampling(1.0, 20))  # sampled: one policy at any load
    with pytest.raises(SystemExit) as exit_info:
        plan.main(planned["args"] + ["--concurrency", "1,4", "--temperature", "1", "--out", str(tmp_path / "t.json")])
    assert exit_info.value.code == 2 and "--concurrency plans greedy decoding only" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        plan.main(planned["args"] + ["--concurrency", "0,4", "--out", str(tmp_path / "t.json")])
    assert exit_info.value.code == 2 and "from 1 to 16" in capsys.readouterr().err
