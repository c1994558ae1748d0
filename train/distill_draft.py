"""Train the draft by distillation from the frozen oracle.

    accelerate launch train/distill_draft.py --preset paper --teacher RUN/oracle --data RUN/data --out RUN/draft

The student is built from the preset's shape with the teacher's tokenizer, of the teacher's family (a GPT-2, or a
Llama-family model for a Llama-family teacher: --arch). Its loss is
kd_weight * T^2 * D(teacher, student) on temperature-softened logits plus (1 - kd_weight) *
cross-entropy on the data, D the forward KL(teacher || student) (--kd-loss forward), the reverse KL
or the total variation distance. With --teacher-windows F a share F of the training windows end with the
teacher's own continuation of a corpus window or of a harvested prompt (train/continuations.py), what
the draft reads when decoding. At the end it reports, on the validation split, how often the student's top-1 token equals
the teacher's (greedy acceptance), the student's mean probability of the teacher's greedy token, and
the expected acceptance of speculative sampling, sum_x min(p(x), q(x)): the numbers that predict
acceptance in speculative decoding. The first and the last are reported twice: on corpus windows,
and on the teacher's greedy continuations of validation prefixes ("..._on_teacher_output").
"""
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run by its path: the repository's folders import

import numpy as np
import torch
import torch.nn.functional as F

from data.shards import token_dtype
from decode.errors import InputError, exits_on_input_error
from decode.models.pretrained import load_causal_lm
from decode.tokenizer import load_tokenizer
from train.architectures import family_of
from train.continuations import POOL_FILE, PoolWindows, build_pool, prompt_prefixes, random_prefixes, teacher_continuations
from train.loop import PackedWindows, build_model, check_same_tokenizer, eval_windows, next_token_loss, report, start_run, train
from train.presets import DRAFT_PRESETS, SIZED_FOR, DistillArgs, fitted_shape, parse_args
from train.teacher_init import copy_teacher_embeddings, copy_teacher_layers, principal_directions
from train.teacher_targets import TargetWindows, check_targets_from, copy_targets, load_or_build_targets, sparse_terms, top_k_targets
from train.work_dir import load_or_build_arrays


def load_teacher(args: DistillArgs, tokenizer):
    if not (Path(args.teacher) / "config.json").is_file():
        raise InputError(f"no trained model in --teacher {args.teacher}; train the oracle first (train/finetune_oracle.py)")
    teacher = load_causal_lm(args.teacher, "teacher (--teacher)")
    check_same_tokenizer(tokenizer, args.teacher, load_tokenizer(args.teacher), teacher.config.vocab_size)
    return teacher.eval().requires_grad_(False)


def divergence(student_logp: torch.Tensor, teacher_logp: torch.Tensor, kind: str) -> torch.Tensor:
    """Mean over positions of a divergence between the teacher's distribution p and the student's q:
    forward KL(p || q), reverse KL(q || p), or total variation 1/2 sum |p - q| (one minus speculative
    sampling's acceptance rate, the quantity DistillSpec relates to speed)."""
    student_logp, teacher_logp = student_logp.flatten(0, -2), teacher_logp.flatten(0, -2)
    if kind == "forward":
        return F.kl_div(student_logp, teacher_logp, log_target=True, reduction="batchmean")
    if kind == "reverse":
        return F.kl_div(teacher_logp, student_logp, log_target=True, reduction="batchmean")
    return 0.5 * (student_logp.exp() - teacher_logp.exp()).abs().sum(-1).mean()


def loss_terms(logits: torch.Tensor, windows: torch.Tensor, targets, kd_weight: float, temperature: float,
               kind: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, divergence, cross-entropy) from the student's float32 logits and the teacher's: its logits (dense)
    or its top-k targets (ids, logp) (sparse)."""
    if isinstance(targets, tuple):
        kd, ce = sparse_terms(logits, windows, *targets, temperature, kind)
    else:
        targets = targets[..., : logits.shape[-1]]  # a hub teacher may pad its embedding matrix
        kd = divergence(F.log_softmax(logits / temperature, -1), F.log_softmax(targets / temperature, -1), kind)
        ce = next_token_loss(logits, windows)
    kd = kd * temperature**2
    return kd_weight * kd + (1 - kd_weight) * ce, kd, ce


def distillation_loss(teacher, kd_weight: float, temperature: float, kind: str, autocast, compiled: bool = False):
    """`autocast`: the accelerator's, which only wraps the prepared student; the teacher needs it too.
    A batch is windows (the teacher runs on them) or (windows, ids, logp) with the teacher's precomputed
    top-k targets (train/teacher_targets.py). `compiled`: the teacher's forward and the loss terms through
    torch.compile, which fuses the passes over batch x positions x vocabulary that dominate a small student's step."""

    def terms(logits, windows, targets):
        return loss_terms(logits, windows, targets, kd_weight, temperature, kind)

    forward = teacher
    if compiled:
        terms, forward = torch.compile(terms), torch.compile(teacher)

    def loss_fn(student, batch):
        if isinstance(batch, (list, tuple)):
            windows, targets = batch[0], tuple(batch[1:])
        else:
            windows = batch
            with torch.no_grad(), autocast():
                targets = forward(windows).logits.float()
        loss, kd, ce = terms(student(windows).logits.float(), windows, targets)
        return loss, {"kd": kd.item(), "ce": ce.item()}

    return loss_fn


@torch.no_grad()
def agreement_on(student, teacher, windows: torch.Tensor, first: int, batch_size: int, accelerator) -> tuple[float, float, float]:
    """Over positions `first`.. of each window: how often the student's top-1 token is the teacher's, the
    student's mean probability of the teacher's argmax token, and the expected acceptance rate of
    speculative sampling at temperature 1 (sum_x min(p, q), one minus the total variation distance)."""
    matches, probability, acceptance, count = 0.0, 0.0, 0.0, 0
    for batch in windows.split(batch_size):
        inputs = batch.to(accelerator.device)
        with accelerator.autocast():
            s = student(inputs).logits.float()[:, first:]
            t = teacher(inputs).logits.float()[:, first:, : s.shape[-1]]
        target = t.argmax(-1)
        q = s.softmax(-1)
        matches += (s.argmax(-1) == target).sum().item()
        probability += q.gather(-1, target[..., None]).sum().item()
        acceptance += torch.minimum(q, t.softmax(-1)).sum().item()
        count += target.numel()
    return matches / count, probability / count, acceptance / count


OUTPUT_WINDOWS = 64  # validation prefixes the teacher continues greedily for the agreement on its own output


def agreement(student, teacher, val_tokens, args: DistillArgs, accelerator) -> dict:
    """Agreement with the teacher on validation windows of the corpus, and on the teacher's greedy
    continuations of validation prefixes (what the draft reads when decoding greedily)."""
    student.eval()
    # the same windows however the batch is split over processes
    windows = eval_windows(val_tokens, args.seq_len, args.agreement_batches * args.batch_size * accelerator.num_processes)
    top1, probability, acceptance = agreement_on(student, teacher, windows, 0, args.batch_size, accelerator)
    prefix = args.seq_len - args.continuation_tokens
    prefixes = random_prefixes(val_tokens, OUTPUT_WINDOWS, prefix, np.random.default_rng(args.seed))
    with accelerator.autocast():
        outputs = torch.cat([teacher_continuations(teacher, batch.to(accelerator.device), args.continuation_tokens, 0.0,
                                                   teacher.config.eos_token_id) for batch in prefixes.split(4 * args.batch_size)])
    output_top1, _, output_acceptance = agreement_on(student, teacher, outputs, prefix - 1, args.batch_size, accelerator)
    student.train()
    return {
        "top1_agreement": top1,
        "mean_prob_of_teacher_token": probability,
        "expected_acceptance": acceptance,
        "top1_agreement_on_teacher_output": output_top1,
        "expected_acceptance_on_teacher_output": output_acceptance,
        "teacher": str(Path(args.teacher).resolve()),
    }


def training_windows(run, args: DistillArgs, teacher, vocab_size: int) -> torch.utils.data.Dataset | None:
    """Corpus windows, with --teacher-windows of them replaced by teacher windows; with --sparse-targets a
    fixed set of them, 1 / --target-epochs of what the run draws, with the teacher's top-k targets.
    None: the whole corpus, dense."""
    if not args.teacher_windows and not args.sparse_targets:
        return None
    accelerator = run.accelerator
    drawn = args.max_steps * args.batch_size * args.grad_accum * accelerator.num_processes
    needed = math.ceil(drawn / args.target_epochs) if args.sparse_targets else drawn
    count = max(1, round(args.teacher_windows * needed)) if args.teacher_windows else 0

    def build_pool_windows():
        rng, length = np.random.default_rng(args.seed), args.seq_len - args.continuation_tokens
        if args.teacher_prefixes == "prompts":
            prefixes = prompt_prefixes(run.train_tokens, run.tokenizer, count, length, rng)
        else:
            prefixes = random_prefixes(run.train_tokens, count, length, rng)
        return {"windows": build_pool(teacher, prefixes, args.continuation_tokens, args.continuation_temperature,
                                      teacher.config.eos_token_id, args.seed, 8 * args.batch_size, accelerator.device,
                                      accelerator.autocast)}

    corpus = PackedWindows(run.train_tokens, args.seq_len)
    kept = np.random.default_rng(args.seed).permutation(len(corpus))[: max(needed - count, 0)]
    parts = [torch.utils.data.Subset(corpus, kept.tolist())]
    with accelerator.main_process_first():
        if args.targets_from and accelerator.is_main_process:
            copy_targets(Path(args.targets_from), run.work_dir)
        if count:
            pool = load_or_build_arrays(run.work_dir / POOL_FILE, build_pool_windows, {"windows": (count, args.seq_len)},
                                        {"windows": token_dtype(teacher.config.vocab_size)})
            parts.append(PoolWindows(pool["windows"]))
        windows = torch.utils.data.ConcatDataset(parts)
        if not args.sparse_targets:
            return windows
        targets = load_or_build_targets(
            run.work_dir, lambda: top_k_targets(teacher, windows, args.sparse_targets, args.kd_temperature, vocab_size,
                                                args.batch_size, accelerator.device, accelerator.autocast),
            len(windows), args.seq_len, args.sparse_targets)
    return TargetWindows(windows, targets)


def fit_to_teacher(args: DistillArgs) -> None:
    """The student's shape fitted to the teacher's width (`--draft-shape fit`: presets.fitted_shape), said in a line."""
    try:
        config = json.loads((Path(args.teacher) / "config.json").read_text())
    except (OSError, ValueError):
        return  # load_teacher says what is wrong with the teacher
    width = config.get("hidden_size") or config.get("n_embd")
    fitted = fitted_shape(args, width) if isinstance(width, int) else None
    if fitted is not None:
        preset = f"{args.n_layer}x{args.n_embd}"
        args.n_layer, args.n_head, args.n_embd = fitted
        print(f"draft shape {args.n_layer}x{args.n_embd} (the {args.preset} preset's {preset} for a teacher {SIZED_FOR[args.preset]} "
              f"wide, scaled to this one's {width}; --draft-shape preset keeps {preset})")


@exits_on_input_error
def main(argv=None) -> dict:
    args = parse_args(DistillArgs, DRAFT_PRESETS, __doc__.split("\n\n")[0], argv, prog="python train/distill_draft.py")
    fit_to_teacher(args)
    if args.targets_from:
        check_targets_from(args)
    run = start_run(args)
    teacher = load_teacher(args, run.tokenizer).to(run.accelerator.device)
    # the teacher's output rows (padding too), of its family by default
    student = build_model(args, run.tokenizer, teacher.config.vocab_size, teacher.config)
    vocab_size = student.config.vocab_size
    if args.teacher_embeddings:  # --teacher-layers needs it (DistillArgs.check): both read the stream through one basis
        basis, share = principal_directions(teacher, student)
        copy_teacher_embeddings(teacher, student, basis)
        if args.teacher_layers and family_of(student.config) != "gpt2":
            print("note: --teacher-layers starts a GPT-2 student's blocks only: this Llama-family student starts from the "
                  "teacher's embeddings alone", file=sys.stderr)
        elif args.teacher_layers:
            copy_teacher_layers(teacher, student, basis, share)
    if args.sparse_targets > vocab_size:
        raise InputError(f"--sparse-targets {args.sparse_targets} exceeds the vocabulary ({vocab_size} tokens)")
    metrics = train(
        run,
        student,
        distillation_loss(teacher, args.kd_weight, args.kd_temperature, args.kd_loss, run.accelerator.autocast,
                          args.compile_loss),
        lambda trained: agreement(trained, teacher, run.val_tokens, args, run.accelerator),
        lambda: training_windows(run, args, teacher, vocab_size),
    )
    report(args, metrics)
    return metrics


if __name__ == "__main__":
    main()
