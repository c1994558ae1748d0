"""Plans the commands set aside or refuse, each in one line: a plan for other models, settings, a dtype or CUDA
graphs, a damaged copy, and a plan file decode.plan did not write."""
import dataclasses
import json
import logging
import re
import shlex
import shutil

import pytest

from decode import SpeculativeDecoder, plan_file
from decode.cli import plan, run
from decode.devices import CPU_CHAIN, GPU
from decode.drafting import ShapedTreeDrafter
from decode.errors import InputError
from decode.options import PAPER_BUDGET, DecoderOptions, default_tree
from decode.resolution import Resolved
from decode.sampling import Sampling


@pytest.fixture(scope="module")
def models(plan_run_models):
    return plan_run_models


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
    assert f"planned with its ngram, and the ngram {copy / 'ngram'} does not exist" in capsys.readouterr().err
    (copy / "ngram").write_text("not a trigram")
    with pytest.raises(SystemExit):
        run.main(["--run", str(copy), "--plan", str(copy / "plan.json"), "--method", "ngram", "--prompts", prompts])
    assert f"the ngram {copy / 'ngram'} is a file, not a directory" in capsys.readouterr().err


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
    assert "python -m decode.plan --oracle" in str(refused.value) and "--no-cuda-graphs" not in str(refused.value)
    graphless = run.parse(args + ["--plan", str(path), "--no-cuda-graphs"]).options
    assert plan_file.load_plan(path, dataclasses.replace(graphless, device="cuda")) == planned["plan"]["policies"]
    assert "--no-cuda-graphs" in plan_file.replan(None, graphless, out=path)[0]
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


def test_a_plan_made_without_compiled_layers_is_refused_with_them_on_a_gpu(planned, monkeypatch):
    path, args = planned["path"], planned["args"]
    compiled = run.parse(args + ["--plan", str(path), "--compile-layers"]).options
    assert compiled.compile_layers and plan_file.load_plan(path, compiled) == planned["plan"]["policies"]  # a CPU's
    monkeypatch.setattr(plan_file, "device_name", lambda device: planned["plan"]["identity"]["device"])
    on_gpu = dataclasses.replace(compiled, device="cuda")
    with pytest.raises(InputError, match=r"compile_layers False \(now True\)") as refused:
        plan_file.load_plan(path, on_gpu)
    assert "--compile-layers" in str(refused.value)
    older = json.loads(path.read_text())
    del older["identity"]["compile_layers"]  # a plan written before the setting: made without them
    older["identity"]["cuda_graphs"] = True
    path.write_text(json.dumps(older))
    assert plan_file.load_plan(path, dataclasses.replace(on_gpu, compile_layers=False)) == planned["plan"]["policies"]


def test_tree_methods_without_a_plan_say_what_they_draft_on_this_device(planned, models, tmp_path, capsys, caplog):
    """Without a plan on a CPU, staged drafts the draft's chain (the shape plans choose there) and the tree method a
    tree sized for a CPU; both say so, with the command that plans them. A tree sized by hand stays as typed."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    for part in ("oracle", "draft", "ngram"):
        (run_dir / part).symlink_to(models[part])
    prompts = ["--prompts", planned["args"][planned["args"].index("--prompts") + 1]]
    options = run.parse(["--run", str(run_dir), *prompts]).options
    chain = list(range(-1, CPU_CHAIN[0]))
    assert options.plan is None and options.tree_shape.parents == chain and options.widths == []
    note = capsys.readouterr().err
    assert "no plan for this setting in" in note and f"the draft's chain of {CPU_CHAIN[0]} tokens" in note
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
        decoder = SpeculativeDecoder.from_run(run_dir, method="staged")
    assert "the draft's chain of" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="decode"):  # a request at a setting of its own (the server's): the same
        decoder.generate("t3 t9", max_new_tokens=4, do_sample=True, temperature=0.7)
    assert f"no plan for this setting in {run_dir} (plan-t0.7-k0-p1.json)" in caplog.text
    assert f"python -m decode.plan --run {run_dir} --dtype float32 --temperature 0.7 --top-k 0 --top-p 1`" in caplog.text


def test_a_gpu_without_a_plan_drafts_what_measured_no_slower_than_plain_decoding(planned, models, tmp_path, capsys):
    """On a GPU without a plan, staged's tree is the one planned there (not the paper's), and staged by default gives
    way to plain decoding when sampling; a method the caller names keeps staged. No GPU is needed: the options are resolved,
    not run."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    for part in ("oracle", "draft", "ngram"):
        (run_dir / part).symlink_to(models[part])
    assert default_tree("cuda") == (GPU.budget, list(GPU.widths)) and GPU.budget < PAPER_BUDGET
    base = DecoderOptions(oracle=models["oracle"], draft=models["draft"], ngram=models["ngram"], device="cuda")
    sampled = Sampling(1.0, 50)
    resolved = Resolved(base, frozenset(), run_dir, None, run_plans=True)
    assert (resolved.options().method, resolved.options(sampled).method) == ("staged", "baseline")
    assert resolved.options(sampled, "staged").method == "staged"  # the bench names each method it measures
    [note] = resolved.notes(sampled)
    assert "so staged uses baseline (the oracle alone)" in note and "--temperature 1 --top-k 50" in note
    assert dataclasses.replace(resolved, given=frozenset({"method"})).options(sampled).method == "staged"
    prompts = ["--prompts", planned["args"][planned["args"].index("--prompts") + 1]]
    for args, given in (([], False), (["--method", "staged"], True)):  # whether the method was typed reaches the rule
        settings = run.parse(["--run", str(run_dir), *prompts, *args])
        assert settings.options.method == "staged" and ("method" in settings.flags.given) == given


def test_plan_refuses_to_replace_a_file_it_did_not_write_and_a_bad_projection(planned, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        plan.main(planned["args"] + ["--out", str(planned["path"])])
    assert exit_info.value.code == 2 and "--overwrite" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        plan.main(planned["args"] + ["--out", str(tmp_path / "x.json"), "--project-oracle", "12,100,50"])
    assert exit_info.value.code == 2 and "multiple of 64" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        plan.main(planned["args"] + ["--out", str(tmp_path / "x.json"), "--project-draft", "draft-40m"])
    assert exit_info.value.code == 2 and "give --project-oracle too" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        plan.main(planned["args"] + ["--out", str(tmp_path / "x.json"), "--project-oracle", "gpt2-large",
                                     "--project-draft", "draft-4m"])
    assert exit_info.value.code == 2 and "--project-draft 'draft-4m'" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


def test_a_plan_that_sets_what_no_plan_fills_is_refused(planned, tmp_path, capsys):
    """A policy fills in only the DecoderOptions fields marked as planned (decode.options.setting): a plan that sets
    another (here the sampling temperature, which is the request's) was not written by decode.plan."""
    written = json.loads(planned["path"].read_text())
    method = next(iter(written["policies"]))
    written["policies"][method]["temperature"] = 1.0
    altered = tmp_path / "plan.json"
    altered.write_text(json.dumps(written))
    with pytest.raises(SystemExit) as exit_info:
        run.main(planned["args"] + ["--plan", str(altered), "--method", method, "--limit", "1"])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and len(err.splitlines()) == 1
    assert "sets temperature, which no plan fills in" in err and "--no-plan" in err


def suggested_plan(message: str) -> tuple:
    """The decode.plan command a message suggests, parsed by decode.plan itself (so its flags and paths are real)."""
    command = re.search(r"`(python -m decode\.plan [^`]*)`", message)[1]
    argv = shlex.split(command)[3:]
    assert "RUN" not in argv, command
    return plan.parse(argv)


def test_every_re_plan_command_suggested_is_one_decode_plan_takes(planned, models, tmp_path):
    path, args = planned["path"], planned["args"]
    on_cpu = run.parse(args + ["--plan", str(path)]).options
    bfloat16 = dataclasses.replace(on_cpu, dtype="bfloat16")  # measured in float32: refused, no run around it
    with pytest.raises(InputError) as refused:
        plan_file.load_plan(path, bfloat16)
    known, settings = suggested_plan(str(refused.value))
    assert known.out == path and known.overwrite and settings.flags.base.dtype == "bfloat16"
    assert settings.flags.base.oracle == on_cpu.oracle and settings.prompts == planned["plan"]["calibration"]["prompts"]
    with pytest.raises(InputError) as missing:
        plan_file.load_plan(tmp_path / "none.json", on_cpu)
    assert suggested_plan(str(missing.value))[0].out == tmp_path / "none.json"

    run_dir = tmp_path / "run"  # a run, decoded with another oracle than its own: the run's plan stays its own
    run_dir.mkdir()
    for part in ("oracle", "draft", "ngram"):
        (run_dir / part).symlink_to(models[part])
    (run_dir / "plan.json").write_text(path.read_text())
    other = dataclasses.replace(on_cpu, oracle=models["draft"])
    with pytest.raises(InputError) as changed:
        plan_file.load_plan(run_dir / "plan.json", other)
    known, settings = suggested_plan(str(changed.value))
    assert settings.run == run_dir and settings.flags.base.oracle == models["draft"]
    assert known.out != run_dir / "plan.json" and f"then pass --plan {known.out}" in str(changed.value)


@pytest.mark.parametrize("flag, value, said", [("--screen", "1", "--screen must be at least 2 (got 1)"),
                                                ("--max-budget", "600", "--max-budget 600 is out of range: use 2..512"),
                                                ("--max-depth", "0", "--max-depth 0 is out of range: use 1..16")])
def test_a_planning_setting_out_of_range_is_a_usage_error_naming_it(planned, tmp_path, capsys, flag, value, said):
    with pytest.raises(SystemExit) as exit_info:
        plan.main(planned["args"] + ["--out", str(tmp_path / "x.json"), flag, value])
    assert exit_info.value.code == 2 and said in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()
