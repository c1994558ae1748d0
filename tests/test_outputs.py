"""No command loses a user's files: outputs are checked before work, replaced only with --overwrite and
only by an artifact of the same kind; damaged inputs, interrupted runs and resumes fail or finish cleanly."""
import json
import os
import signal

import numpy as np
import pytest
import torch
from conftest import write_corpus
from decode_models import run_models
from safetensors.torch import load_file

from data import prepare
from decode.cli import agreement, bench, bench_engine, export, quantize, run
from ngram import build_katz
from train import distill_draft, finetune_oracle

TRAIN_FAST = ["--max-steps", "12", "--warmup-steps", "2"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A prepared run with a tiny oracle, draft and trigram, and a run of another tokenizer."""
    root = tmp_path_factory.mktemp("outputs")
    write_corpus(root / "src")
    runs = {}
    for name, vocab in (("run", 400), ("other", 300)):
        prepare.main(["--path", str(root / "src"), "--out", str(root / name), "--vocab-size", str(vocab), "--val-fraction", "0.3"])
        finetune_oracle.main(["--data", str(root / name / "data"), "--out", str(root / name / "oracle"), *TRAIN_FAST])
        runs[name] = root / name
    r = runs["run"]
    distill_draft.main(["--data", str(r / "data"), "--teacher", str(r / "oracle"), "--out", str(r / "draft"), *TRAIN_FAST])
    build_katz.main(["--out", str(r / "ngram")])
    distill_draft.main(["--data", str(runs["other"] / "data"), "--teacher", str(runs["other"] / "oracle"),
                        "--out", str(runs["other"] / "draft"), *TRAIN_FAST])
    return runs


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return run_models(tmp_path_factory.mktemp("decode"))


def one_line_error(capsys, main, argv) -> str:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if line.startswith("error:") or ": error:" in line]
    assert len(errors) == 1, err
    return errors[0]


def snapshot(directory) -> dict:
    return {str(p.relative_to(directory)): p.read_bytes() if p.is_file() else None for p in sorted(directory.rglob("*"))}


def leftovers(directory) -> list[str]:
    return [p.name for p in directory.rglob("*") if ".tmp-" in p.name or ".old-" in p.name]


def commands(trained, models):
    """Every command with an output flag, as (main, argv with the output flag set to a path)."""
    r, m = trained["run"], models
    decode = ["--oracle", str(m["oracle"]), "--draft", str(m["draft"]), "--ngram", str(m["ngram"]),
              "--prompt", "t1 t2", "--max-new-tokens", "4"]
    train = ["--data", str(r / "data"), *TRAIN_FAST]
    distill = [*train, "--teacher", str(r / "oracle")]
    prompts = r / "prompts.jsonl"
    return {
        "data.prepare --out": (prepare.main, lambda p: ["--path", str(r.parent / "src"), "--out", str(p)]),
        "build_katz --out": (build_katz.main, lambda p: ["--data", str(r / "data"), "--out", str(p)]),
        "finetune_oracle --out": (finetune_oracle.main, lambda p: [*train, "--out", str(p)]),
        "finetune_oracle --work-dir": (finetune_oracle.main, lambda p: [*train, "--out", str(p.parent / "o"), "--work-dir", str(p)]),
        "distill_draft --out": (distill_draft.main, lambda p: [*distill, "--out", str(p)]),
        "distill_draft --work-dir": (distill_draft.main, lambda p: [*distill, "--out", str(p.parent / "d"), "--work-dir", str(p)]),
        "decode.run --out": (run.main, lambda p: [*decode, "--out", str(p)]),
        "decode.bench --out": (bench.main, lambda p: [*decode, "--methods", "baseline", "--out", str(p)]),
        "decode.bench --plot": (bench.main, lambda p: [*decode, "--methods", "baseline", "--plot", str(p)]),
        "decode.agreement --out": (agreement.main, lambda p: [*decode, "--methods", "speculative", "--out", str(p)]),
        "decode.bench_engine --out": (bench_engine.main, lambda p: ["--model", str(r / "oracle"), "--prompts", str(prompts),
                                                                       "--skip-large", "--out", str(p)]),
        "decode.quantize --out": (quantize.main, lambda p: ["--model", str(m["oracle"]), "--to", "q8_0", "--out", str(p)]),
    }


COMMANDS = ["data.prepare --out", "build_katz --out", "finetune_oracle --out", "finetune_oracle --work-dir",
            "distill_draft --out", "distill_draft --work-dir", "decode.run --out", "decode.bench --out",
            "decode.bench --plot", "decode.agreement --out", "decode.bench_engine --out", "decode.quantize --out"]


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("overwrite", [False, True])
def test_every_output_flag_refuses_a_directory_holding_a_file(trained, models, tmp_path, capsys, command, overwrite):
    main, argv = commands(trained, models)[command]
    target = tmp_path / "mine"
    target.mkdir()
    (target / "notes.txt").write_text("the user's own file")
    before = snapshot(tmp_path)
    err = one_line_error(capsys, main, argv(target) + (["--overwrite"] if overwrite else []))
    assert str(target) in err
    assert snapshot(tmp_path) == before


def test_no_output_flag_writes_over_or_into_what_its_command_reads(trained, models, tmp_path, capsys):
    r, m = trained["run"], models
    inside = {  # each command's output pointed at one of its own inputs
        "data.prepare --out": r.parent / "src" / "run",
        "build_katz --out": r / "data" / "ngram",
        "finetune_oracle --out": r / "data" / "oracle",
        "distill_draft --out": r / "oracle" / "draft",
        "decode.run --out": m["oracle"] / "config.json",
        "decode.bench --out": m["draft"] / "figures.json",
        "decode.bench --plot": m["ngram"] / "speedups.png",
        "decode.agreement --out": m["oracle"] / "config.json",
        "decode.bench_engine --out": r / "prompts.jsonl",
        "decode.quantize --out": m["oracle"] / "q8_0",
    }
    before = snapshot(r.parent), snapshot(m["oracle"].parent)
    for command, target in inside.items():
        main, argv = commands(trained, models)[command]
        err = one_line_error(capsys, main, argv(target) + ["--overwrite"])
        assert "which this command reads as its" in err, (command, err)
    err = one_line_error(capsys, export.main, ["--oracle", str(m["oracle"]), "--out", str(m["oracle"]), "--overwrite"])
    assert "which this command reads as its oracle" in err
    assert (snapshot(r.parent), snapshot(m["oracle"].parent)) == before


def test_build_katz_into_a_run_or_a_package_leaves_it_whole(trained, tmp_path, capsys):
    r = trained["run"]
    before = snapshot(r)
    for extra in ([], ["--overwrite"]):
        assert "not a trigram directory" in one_line_error(capsys, build_katz.main, ["--data", str(r / "data"), "--out", str(r), *extra])
    assert snapshot(r) == before
    # a trigram directory is replaced with --overwrite only
    out = tmp_path / "ngram"
    build_katz.main(["--data", str(r / "data"), "--out", str(out)])
    assert "pass --overwrite" in one_line_error(capsys, build_katz.main, ["--data", str(r / "data"), "--out", str(out)])
    build_katz.main(["--data", str(r / "data"), "--out", str(out), "--overwrite", "--successors", "4"])
    assert json.loads((out / "meta.json").read_text())["top_k"] == 4 and not leftovers(tmp_path)


def test_prepare_over_a_source_tree_or_a_trained_run_is_refused(trained, tmp_path, capsys):
    project = tmp_path / "project"  # `python -m data.prepare --out .` from the project root
    (project / "data").mkdir(parents=True)
    (project / "data" / "__init__.py").write_text("# the data package\n")
    before = snapshot(project)
    src = str(trained["run"].parent / "src")
    for extra in ([], ["--overwrite"]):
        assert "not a prepared run" in one_line_error(capsys, prepare.main, ["--path", src, "--out", str(project), *extra])
    assert snapshot(project) == before
    r = trained["run"]
    before = snapshot(r)
    assert "pass --overwrite" in one_line_error(capsys, prepare.main, ["--path", src, "--out", str(r)])
    err = one_line_error(capsys, prepare.main, ["--path", src, "--out", str(r), "--overwrite"])
    assert "oracle, draft, ngram" in err and "move them out" in err
    assert snapshot(r) == before


def test_prepare_overwrite_replaces_a_run_without_models(trained, tmp_path):
    src = str(trained["run"].parent / "src")
    out = tmp_path / "run"
    prepare.main(["--path", src, "--out", str(out), "--vocab-size", "300", "--val-fraction", "0.3"])
    prepare.main(["--path", src, "--out", str(out), "--vocab-size", "350", "--val-fraction", "0.3", "--overwrite"])
    assert json.loads((out / "data" / "meta.json").read_text())["vocab_size"] == 350
    assert len(json.loads((out / "tokenizer" / "tokenizer.json").read_text())["model"]["vocab"]) == 350
    assert not leftovers(tmp_path)


def test_a_failed_prepare_leaves_no_empty_out(trained, tmp_path, capsys, monkeypatch):
    (tmp_path / "empty").mkdir()
    out = tmp_path / "new" / "run"
    assert "no .py files" in one_line_error(capsys, prepare.main, ["--path", str(tmp_path / "empty"), "--out", str(out)])
    assert not (tmp_path / "new").exists()

    def no_space(*args):  # a failure while the shards are written, after the run directory was made
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(prepare, "write_split", no_space)
    err = one_line_error(capsys, prepare.main, ["--path", str(trained["run"].parent / "src"), "--out", str(out)])
    assert f"the disk is full writing {out}" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"]


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupted_prepare_removes_its_temporary_files_and_says_so(trained, tmp_path, capsys, monkeypatch, signum,
                                                                     interruptible):
    from data import shards

    def interrupted(*args, **kwargs):  # the signal arrives while the shards are being written
        os.kill(os.getpid(), signum)

    monkeypatch.setattr(shards, "write_meta", interrupted)
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_:
        prepare.main(["--path", str(trained["run"].parent / "src"), "--out", str(out)])
    assert exit_.value.code == 128 + signum
    assert "nothing was written" in capsys.readouterr().err
    assert not out.exists() and not leftovers(tmp_path)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupted_trigram_build_removes_its_temporary_files(trained, tmp_path, capsys, monkeypatch, signum,
                                                                  interruptible):
    monkeypatch.setattr(build_katz, "write_arpa", lambda *a: os.kill(os.getpid(), signum))
    with pytest.raises(SystemExit) as exit_:
        build_katz.main(["--data", str(trained["run"] / "data"), "--out", str(tmp_path / "ngram")])
    assert exit_.value.code == 128 + signum and "nothing was written" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_output_files_are_replaced_only_with_overwrite_and_plots_need_a_known_format(models, tmp_path, capsys):
    decode = ["--oracle", str(models["oracle"]), "--prompt", "t1 t2", "--max-new-tokens", "4", "--method", "baseline"]
    out = tmp_path / "out.jsonl"
    out.write_text("earlier results\n")
    assert "pass --overwrite" in one_line_error(capsys, run.main, [*decode, "--out", str(out)])
    assert out.read_text() == "earlier results\n"
    run.main([*decode, "--out", str(out), "--overwrite"])
    assert json.loads(out.read_text().splitlines()[0])["method"] == "baseline"
    assert "cannot write .xyz" in one_line_error(capsys, bench.main, [*decode, "--methods", "baseline", "--plot", str(tmp_path / "p.xyz")])
    assert "is a file" in one_line_error(capsys, run.main, [*decode, "--out", str(out / "below")])
    assert not leftovers(tmp_path)


def test_a_run_killed_after_its_last_checkpoint_finishes_with_resume(trained, tmp_path):
    data = str(trained["run"] / "data")
    args = ["--data", data, "--out", str(tmp_path / "oracle"), "--max-steps", "16", "--warmup-steps", "2", "--save-every", "8"]
    finetune_oracle.main(args)
    expected = load_file(tmp_path / "oracle" / "model.safetensors")
    for f in (tmp_path / "oracle").iterdir():  # killed between the last checkpoint and the final save
        f.unlink()
    (tmp_path / "oracle").rmdir()
    metrics = finetune_oracle.main(args + ["--resume"])
    assert metrics["step"] == 16 and metrics["val_loss"] is not None
    got = load_file(tmp_path / "oracle" / "model.safetensors")
    assert all(torch.equal(expected[k], got[k]) for k in expected)


@pytest.mark.parametrize("damage, message", [
    (lambda ckpt, work: (ckpt / "optimizer.bin").unlink(), "optimizer.bin"),
    (lambda ckpt, work: (ckpt / "random_states_0.pkl").write_bytes(b""), "random_states_0.pkl"),
    (lambda ckpt, work: [f.unlink() for f in ckpt.iterdir()], "incomplete"),
    (lambda ckpt, work: (work / "args.json").unlink(), "args.json"),
    (lambda ckpt, work: (ckpt / "model.safetensors").write_bytes(b"\0" * 100), "damaged"),
])
def test_resume_refuses_a_damaged_checkpoint(trained, tmp_path, capsys, damage, message):
    args = ["--data", str(trained["run"] / "data"), "--out", str(tmp_path / "oracle"), "--max-steps", "16",
            "--warmup-steps", "2", "--save-every", "8"]
    finetune_oracle.main(args + ["--stop-after-steps", "8"])
    work = tmp_path / "oracle-train"
    damage(work / "checkpoints" / "step-0000008", work)
    assert message in one_line_error(capsys, finetune_oracle.main, args + ["--resume"])
    assert not (tmp_path / "oracle").exists()


def test_work_dir_of_someone_else_is_never_deleted(trained, tmp_path, capsys):
    work = tmp_path / "work"
    work.mkdir()
    (work / "results.csv").write_text("precious")
    argv = ["--data", str(trained["run"] / "data"), "--out", str(tmp_path / "o"), "--work-dir", str(work), *TRAIN_FAST]
    assert "not a training work directory" in one_line_error(capsys, finetune_oracle.main, argv)
    assert (work / "results.csv").read_text() == "precious"


def damaged_copy(model_dir, tmp_path, name, content=b"\x13garbage" * 50):
    import shutil

    copy = tmp_path / name
    shutil.copytree(model_dir, copy)
    (copy / "model.safetensors").write_bytes(content)
    return copy


def test_damaged_weights_are_one_line_errors_everywhere(trained, models, tmp_path, capsys):
    r = trained["run"]
    truncated = (models["oracle"] / "model.safetensors").read_bytes()[:5000]
    bad_oracle = damaged_copy(models["oracle"], tmp_path, "oracle", truncated)
    bad_draft = damaged_copy(models["draft"], tmp_path, "draft")
    decode = ["--prompt", "t1 t2", "--max-new-tokens", "4"]
    assert "model.safetensors" in one_line_error(capsys, run.main, ["--oracle", str(bad_oracle), *decode])
    assert "cannot load the model" in one_line_error(capsys, run.main, ["--oracle", str(bad_oracle), "--backend", "hf", *decode])
    assert "model.safetensors" in one_line_error(capsys, run.main, ["--oracle", str(models["oracle"]), "--draft", str(bad_draft),
                                                                    "--method", "speculative", *decode])
    bad_teacher = damaged_copy(r / "oracle", tmp_path, "teacher")
    err = one_line_error(capsys, distill_draft.main, ["--data", str(r / "data"), "--teacher", str(bad_teacher),
                                                      "--out", str(tmp_path / "d"), *TRAIN_FAST])
    assert "cannot load the teacher" in err
    bad_sampler = damaged_copy(r / "draft", tmp_path, "sampler")
    err = one_line_error(capsys, build_katz.main, ["--data", str(r / "data"), "--from-draft", str(bad_sampler), "--num-tokens", "100",
                                                   "--out", str(tmp_path / "ng")])
    assert "cannot load the draft model" in err
    assert not (tmp_path / "d").exists() and not (tmp_path / "ng").exists()


def test_a_damaged_successor_table_is_a_one_line_error(models, tmp_path, capsys):
    import shutil

    ngram = tmp_path / "ngram"
    shutil.copytree(models["ngram"], ngram)
    data = (ngram / "successors.npz").read_bytes()
    argv = ["--oracle", str(models["oracle"]), "--ngram", str(ngram), "--method", "ngram", "--prompt", "t1", "--max-new-tokens", "4"]
    for content in (data[: len(data) // 2], b"not a zip file at all"):
        (ngram / "successors.npz").write_bytes(content)
        assert "successors.npz is damaged" in one_line_error(capsys, run.main, argv)
    np.savez(ngram / "successors.npz", vocab_size=20, eos_id=0, trigram_histories=np.arange(3))  # an earlier format
    assert "is not a successor table of this version" in one_line_error(capsys, run.main, argv)


def test_bad_devices_limits_and_counts_are_one_line_errors(trained, models, tmp_path, capsys):
    decode = ["--oracle", str(models["oracle"]), "--prompt", "t1", "--max-new-tokens", "4"]
    if not torch.cuda.is_available():
        assert "no CUDA device" in one_line_error(capsys, run.main, [*decode, "--device", "cuda"])
    assert "unknown --device 'gpu'" in one_line_error(capsys, run.main, [*decode, "--device", "gpu"])
    prompts = ["--oracle", str(models["oracle"]), "--prompts", str(trained["run"] / "prompts.jsonl")]
    for limit in ("0", "-3"):
        assert "--limit must be at least 1" in one_line_error(capsys, run.main, [*prompts, "--limit", limit])
    src = str(trained["run"].parent / "src")
    assert "--num-prompts" in one_line_error(capsys, prepare.main, ["--path", src, "--out", str(tmp_path / "r"), "--num-prompts", "-1"])


def test_bad_trigram_inputs_are_one_line_errors(trained, tmp_path, capsys):
    data = ["--data", str(trained["run"] / "data"), "--out", str(tmp_path / "ng")]
    assert "at least 1" in one_line_error(capsys, build_katz.main, [*data, "--max-tokens", "0"])
    assert "at least 1" in one_line_error(capsys, build_katz.main, ["--from-draft", str(trained["run"] / "draft"), "--num-tokens", "0",
                                                                    "--out", str(tmp_path / "ng")])
    assert "positive and finite" in one_line_error(capsys, build_katz.main, ["--from-draft", str(trained["run"] / "draft"),
                                                                             "--temperature", "nan", "--out", str(tmp_path / "ng")])
    binary = tmp_path / "tokens.bin"
    binary.write_bytes(bytes(range(256)) * 8)
    tokens = ["--tokens", str(binary), "--vocab-size", "100", "--out", str(tmp_path / "ng")]
    assert "not UTF-8" in one_line_error(capsys, build_katz.main, tokens)
    text = tmp_path / "tokens.txt"
    text.write_text("1 2 3\n4 5 6\n")
    assert "--eos-id" in one_line_error(capsys, build_katz.main, ["--tokens", str(text), "--vocab-size", "10", "--eos-id", "10",
                                                                  "--out", str(tmp_path / "ng")])
    other_draft = trained["other"] / "draft"
    err = one_line_error(capsys, build_katz.main, [*data[:2], "--from-draft", str(other_draft), "--num-tokens", "100", *data[2:]])
    assert "another tokenizer" in err
    assert not (tmp_path / "ng").exists()



def test_no_report_goes_into_a_runs_own_files_whether_or_not_the_command_reads_them(trained, models, tmp_path, capsys):
    r = trained["run"]
    (r / "plan-t1-k50-p1.json").write_text('{"a sampled plan": true}')
    before = snapshot(r)
    for target in (r / "plan-t1-k50-p1.json", r / "data" / "meta.json", r / "tokenizer" / "notes.json",
                   r / "oracle-q8_0" / "records.jsonl"):
        for command in ("decode.run --out", "decode.bench --out", "decode.bench_engine --out"):
            main, argv = commands(trained, models)[command]
            err = one_line_error(capsys, main, argv(target) + ["--overwrite"])
            assert "one of the run" in err and "own files" in err, (command, target, err)
    assert snapshot(r) == before
    (r / "plan-t1-k50-p1.json").unlink()


def test_the_bench_refuses_an_out_on_a_disk_too_full_for_its_records_before_it_runs(models, tmp_path, capsys,
                                                                                   monkeypatch):
    import shutil

    from decode import atomic

    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(atomic.shutil, "disk_usage", lambda where: usage._replace(free=20_000))
    monkeypatch.setattr(bench, "timed_runs", lambda *a: pytest.fail("the benchmark ran before the check"))
    out = tmp_path / "bench.json"
    err = one_line_error(capsys, bench.main, ["--oracle", str(models["oracle"]), "--prompt", "t1 t2", "--max-new-tokens",
                                              "4", "--methods", "baseline", "--out", str(out)])
    assert f"{out} will take about" in err and "20,000 free" in err
    assert list(tmp_path.iterdir()) == []


def test_a_full_disk_is_one_line_naming_the_output_and_leaves_nothing_there(models, tmp_path, capsys, monkeypatch):
    import errno
    from pathlib import Path

    real = Path.write_text

    def full(self, *args, **kwargs):  # the disk fills up as the output is written
        if ".tmp-" in self.name:
            real(self, "partial")
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", full)
    out = tmp_path / "records.jsonl"
    err = one_line_error(capsys, run.main, ["--oracle", str(models["oracle"]), "--prompt", "t1 t2", "--max-new-tokens",
                                            "2", "--method", "baseline", "--out", str(out)])
    assert f"the disk is full writing {out}" in err and "bytes free" in err
    assert list(tmp_path.iterdir()) == []
