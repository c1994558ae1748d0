"""Llama-family training: an oracle built with --arch llama learns; a draft distilled from it is of its family and
shares its rotary positions; the teacher's embeddings start it; --init fine-tunes a Llama-family checkpoint; and the
lean engine decodes the pair exactly."""
import json

import pytest
import torch
from train_runs import error_of, prepared_run
from transformers import AutoConfig, AutoModelForCausalLM

from decode.cli import run as decode_run
from decode.models.llama import LlamaEngine
from decode.models.loading import load_model
from train import distill_draft, finetune_oracle
from train.architectures import model_config
from train.teacher_init import copy_teacher_embeddings, principal_directions


@pytest.fixture(scope="module")
def trained_llama_run(tmp_path_factory):
    run = prepared_run(tmp_path_factory.mktemp("train-llama"))
    metrics = finetune_oracle.main(["--data", str(run / "data"), "--out", str(run / "oracle"), "--arch", "llama",
                                    "--n-head", "4"])
    return run, metrics


def test_a_llama_oracle_learns_and_its_distilled_draft_is_of_its_family(trained_llama_run, tmp_path, capsys):
    run, metrics = trained_llama_run
    assert metrics["val_loss"] < 0.5 * metrics["val_loss_initial"]
    oracle = AutoConfig.from_pretrained(run / "oracle")
    assert oracle.model_type == "llama" and oracle.num_key_value_heads == 2  # half the heads: grouped-query attention
    distill_draft.main(["--data", str(run / "data"), "--teacher", str(run / "oracle"), "--out", str(tmp_path / "draft"),
                        "--draft-shape", "1x32", "--teacher-embeddings", "True", "--teacher-layers", "True"])
    assert "starts from the teacher's embeddings alone" in capsys.readouterr().err
    draft = AutoConfig.from_pretrained(tmp_path / "draft")
    assert (draft.model_type, draft.num_hidden_layers, draft.hidden_size) == ("llama", 1, 32)
    assert draft.rope_parameters == oracle.rope_parameters and draft.max_position_embeddings == oracle.max_position_embeddings
    assert isinstance(load_model(tmp_path / "draft", "auto", "float32", "cpu"), LlamaEngine)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"task_id": f"t{i}", "prompt": p}) + "\n"
                               for i, p in enumerate(["def scale_1(values", "import math\n", "class Box3:\n"])))
    common = ["--oracle", str(run / "oracle"), "--draft", str(tmp_path / "draft"), "--prompts", str(prompts),
              "--max-new-tokens", "24", "--dtype", "float32"]
    base = decode_run.main(common + ["--method", "baseline", "--out", str(tmp_path / "base.jsonl")])
    spec = decode_run.main(common + ["--method", "speculative", "--k", "4", "--out", str(tmp_path / "spec.jsonl")])
    assert [r["token_ids"] for r in base] == [r["token_ids"] for r in spec]


def test_a_llama_students_embeddings_start_as_the_teachers_through_their_principal_directions():
    teacher = AutoModelForCausalLM.from_config(model_config("llama", 2, 4, 2, 64, 97, 64, 0))
    student = AutoModelForCausalLM.from_config(model_config("llama", 1, 1, 0, 32, 97, 64, 0, teacher=teacher.config))
    basis, _ = principal_directions(teacher, student)
    copy_teacher_embeddings(teacher, student, basis)
    expected = teacher.get_input_embeddings().weight.detach() @ basis
    assert torch.allclose(student.get_input_embeddings().weight.detach(), expected, atol=1e-6)
    gpt2 = AutoModelForCausalLM.from_config(model_config("gpt2", 1, 1, 0, 32, 97, 64, 0))
    with pytest.raises(Exception, match="a student of the teacher's family"):
        copy_teacher_embeddings(teacher, gpt2, basis)


def test_init_fine_tunes_a_llama_family_checkpoint(trained_llama_run, tmp_path):
    run, _ = trained_llama_run
    finetune_oracle.main(["--data", str(run / "data"), "--init", str(run / "oracle"), "--out", str(tmp_path / "tuned"),
                          "--max-steps", "12", "--warmup-steps", "2"])
    before, after = (AutoModelForCausalLM.from_pretrained(d) for d in (run / "oracle", tmp_path / "tuned"))
    assert after.config.model_type == "llama"
    assert not torch.equal(before.model.layers[0].mlp.up_proj.weight, after.model.layers[0].mlp.up_proj.weight)


def test_an_architecture_it_does_not_build_is_a_one_line_error(trained_llama_run, tmp_path, capsys):
    run, _ = trained_llama_run
    error = error_of(capsys, finetune_oracle.main, ["--data", str(run / "data"), "--out", str(tmp_path / "o"),
                                                    "--arch", "falcon"])
    assert "--arch 'falcon': choose one of gpt2, llama, qwen2, mistral" in error and not (tmp_path / "o").exists()
    error = error_of(capsys, distill_draft.main, ["--data", str(run / "data"), "--teacher", str(run / "oracle"),
                                                  "--out", str(tmp_path / "d"), "--draft-shape", "two"])
    assert "--draft-shape 'two': give LAYERSxWIDTH" in error
