"""Train the draft by distillation from the frozen oracle.

    accelerate launch train/distill_draft.py --preset paper --teacher RUN/oracle --data RUN/data --out RUN/draft

The student is a GPT-2 built from the preset's config with the teacher's tokenizer. Its loss is
kd_weight * T^2 * KL(teacher || student) on temperature-softened logits plus (1 - kd_weight) *
cross-entropy on the data. At the end it reports, on the validation split, how often the student's
top-1 token equals the teacher's (greedy acceptance), the student's mean probability of the
teacher's greedy token, and the expected acceptance of speculative sampling, sum_x min(p(x), q(x)):
the numbers that predict acceptance in speculative decoding.
"""
from pathlib import Path

import torch
import torch.nn.functional as F

from data.errors import InputError, exits_on_input_error
from data.pretrained import load_causal_lm
from data.tokenizer import load_tokenizer
from train.loop import build_model, check_same_tokenizer, eval_windows, next_token_loss, report, start_run, train
from train.presets import DRAFT_PRESETS, DistillArgs, parse_args


def load_teacher(args: DistillArgs, tokenizer):
    if not (Path(args.teacher) / "config.json").is_file():
        raise InputError(f"no trained model in --teacher {args.teacher}; train the oracle first (train/finetune_oracle.py)")
    teacher = load_causal_lm(args.teacher, "teacher (--teacher)")
    check_same_tokenizer(tokenizer, args.teacher, load_tokenizer(args.teacher), teacher.config.vocab_size)
    return teacher.eval().requires_grad_(False)


def distillation_loss(teacher, kd_weight: float, temperature: float, autocast):
    """`autocast`: the accelerator's, which only wraps the prepared student; the teacher needs it too."""

    def loss_fn(student, windows):
        with torch.no_grad(), autocast():
            teacher_logits = teacher(windows).logits.float()
        logits = student(windows).logits.float()
        vocab = logits.shape[-1]
        teacher_logits = teacher_logits[..., :vocab]  # a hub teacher may pad its embedding matrix
        kl = F.kl_div(
            F.log_softmax(logits / temperature, -1).flatten(0, 1),
            F.log_softmax(teacher_logits / temperature, -1).flatten(0, 1),
            log_target=True,
            reduction="batchmean",
        ) * temperature**2
        ce = next_token_loss(logits, windows)
        return kd_weight * kl + (1 - kd_weight) * ce, {"kl": kl.item(), "ce": ce.item()}

    return loss_fn


@torch.no_grad()
def agreement(student, teacher, val_tokens, args: DistillArgs, accelerator) -> dict:
    """Top-1 agreement with the teacher, mean student probability of the teacher's argmax token, and the
    expected acceptance rate of speculative sampling at temperature 1 (1 - total variation distance)."""
    student.eval()
    windows = eval_windows(val_tokens, args.seq_len, args.agreement_batches * args.batch_size)
    matches, probability, acceptance, count = 0.0, 0.0, 0.0, 0
    for batch in windows.split(args.batch_size):
        inputs = batch.to(accelerator.device)
        with accelerator.autocast():
            s = student(inputs).logits.float()
            t = teacher(inputs).logits.float()[..., : s.shape[-1]]
        target = t.argmax(-1)
        q = s.softmax(-1)
        matches += (s.argmax(-1) == target).sum().item()
        probability += q.gather(-1, target[..., None]).sum().item()
        acceptance += torch.minimum(q, t.softmax(-1)).sum().item()
        count += target.numel()
    student.train()
    return {
        "top1_agreement": matches / count,
        "mean_prob_of_teacher_token": probability / count,
        "expected_acceptance": acceptance / count,
        "teacher": str(Path(args.teacher).resolve()),
    }


@exits_on_input_error
def main(argv=None) -> dict:
    args = parse_args(DistillArgs, DRAFT_PRESETS, __doc__.split("\n\n")[0], argv)
    if not 0 <= args.kd_weight <= 1 or args.kd_temperature <= 0:
        raise InputError("--kd_weight must lie in [0, 1] and --kd_temperature be positive")
    run = start_run(args)
    teacher = load_teacher(args, run.tokenizer).to(run.accelerator.device)
    student = build_model(args, run.tokenizer)
    metrics = train(
        run,
        student,
        distillation_loss(teacher, args.kd_weight, args.kd_temperature, run.accelerator.autocast),
        lambda trained: agreement(trained, teacher, run.val_tokens, args, run.accelerator),
    )
    report(args, metrics)
    return metrics


if __name__ == "__main__":
    main()
