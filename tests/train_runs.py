"""Prepared runs and trained tiny oracles for the training tests, and the checks those tests share."""
import pytest
import torch
from conftest import write_corpus
from safetensors.torch import load_file

from data import prepare
from train import distill_draft, finetune_oracle


def prepared_run(root, vocab_size=400):
    write_corpus(root / "src")
    prepare.main(["--path", str(root / "src"), "--out", str(root / "run"), "--vocab-size", str(vocab_size),
                  "--val-fraction", "0.3"])
    return root / "run"


def trained_run(root):
    """A prepared run below `root` with a trained tiny oracle, and the training's metrics."""
    run = prepared_run(root)
    metrics = finetune_oracle.main(["--data", str(run / "data"), "--out", str(run / "oracle")])
    return run, metrics


def error_of(capsys, main, argv) -> str:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1
    return errors[0]


def assert_resumed_distillation_matches(argv, tmp_path):
    """A run stopped after 8 steps and resumed ends with the weights of one that ran through."""
    distill_draft.main(argv + ["--out", str(tmp_path / "whole")])
    distill_draft.main(argv + ["--out", str(tmp_path / "parts"), "--stop-after-steps", "8"])
    distill_draft.main(argv + ["--out", str(tmp_path / "parts"), "--resume"])
    assert_same_weights(tmp_path / "whole", tmp_path / "parts")


def assert_same_weights(one, other):
    one, other = load_file(one / "model.safetensors"), load_file(other / "model.safetensors")
    assert one.keys() == other.keys()
    for name in one:
        assert torch.equal(one[name], other[name]), name
