"""The training loop both pipelines share.

Packed fixed-length windows from the token shards, AdamW with warm-up and cosine decay, and
accelerate for devices, processes (DDP/FSDP from `accelerate config`), bf16 autocast, gradient
accumulation, checkpoints and exact resume (model, optimizer, scheduler, RNG and data position). Ctrl-C or SIGTERM
during the steps saves the step under way before stopping (train.interrupts).
"""
import ctypes
import json
import math
import platform
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from data.shards import open_split, read_meta, token_counts
from decode.atomic import atomic_output
from decode.devices import check_compiler
from decode.errors import InputError, check_path, first_line, written
from decode.models.loading import TOKEN_COUNTS
from decode.models.pretrained import load_causal_lm
from decode.tokenizer import load_tokenizer
from train.architectures import family_of, model_config
from train.bf16 import bf16_choice
from train.interrupts import DeferredInterrupts
from train.presets import TrainArgs
from train.tracking import JSONLinesTracker
from train.work_dir import CHECKPOINT_PREFIX, MODEL, check_checkpoint, check_output, checkpoints, read_saved_args, start_work_dir


class PackedWindows(torch.utils.data.Dataset):
    """Consecutive windows of seq_len tokens; each position predicts the next one within its window."""

    def __init__(self, tokens: np.ndarray, seq_len: int):
        self.tokens, self.seq_len = tokens, seq_len

    def __len__(self) -> int:
        return len(self.tokens) // self.seq_len

    def __getitem__(self, i: int) -> torch.Tensor:
        start = i * self.seq_len
        return torch.from_numpy(self.tokens[start : start + self.seq_len].astype(np.int64))


def eval_windows(tokens: np.ndarray, seq_len: int, count: int) -> torch.Tensor:
    """`count` windows spread evenly over a split: the same ones at every evaluation."""
    starts = np.linspace(0, len(tokens) - seq_len, count).astype(np.int64)
    return torch.stack([torch.from_numpy(tokens[s : s + seq_len].astype(np.int64)) for s in starts])


def next_token_loss(logits: torch.Tensor, windows: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of each position's logits against the window's next token."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), windows[:, 1:].flatten())


def language_model_loss(model, windows: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """The same loss computed by the model itself (HF shifts the labels), so torch.compile fuses it."""
    return model(windows, labels=windows).loss, {}




def load_data(args: TrainArgs) -> tuple[dict, np.ndarray, np.ndarray]:
    data_dir = Path(args.data)
    check_path(data_dir, True, "data directory", "run `python -m data.prepare --out RUN` and pass --data RUN/data")
    meta = read_meta(data_dir)
    train, val = open_split(data_dir, "train"), open_split(data_dir, "val")
    for name, tokens in (("train", train), ("val", val)):
        if len(tokens) < args.seq_len:
            raise InputError(f"the {name} split has {len(tokens)} tokens, fewer than one --seq-len {args.seq_len} window; "
                             f"lower --seq-len or prepare more data")
    return meta, train, val


def data_tokenizer(args: TrainArgs, meta: dict):
    return load_tokenizer((Path(args.data) / meta["tokenizer"]).resolve())


def check_same_tokenizer(tokenizer, other_name: str, other_tokenizer, other_vocab: int) -> None:
    """The data's tokenizer and a model's (init checkpoint or teacher) must be the same."""
    if other_vocab < len(tokenizer):
        raise InputError(
            f"vocabulary mismatch: the data's tokenizer has {len(tokenizer)} tokens, {other_name} only {other_vocab}; "
            f"prepare the data with {other_name}'s tokenizer (python -m data.prepare --tokenizer {other_name})"
        )
    if other_tokenizer is not None and other_tokenizer.get_vocab() != tokenizer.get_vocab():
        raise InputError(
            f"tokenizer mismatch: the data was tokenised with another tokenizer than {other_name}'s; "
            f"prepare the data with --tokenizer {other_name}"
        )


def build_model(args: TrainArgs, tokenizer, output_rows: int | None = None, teacher_config=None):
    """A model of the preset's shape and --arch (train.architectures; "teacher": `teacher_config`'s family), or the
    --init checkpoint (checked against the data's tokenizer). A new model's output has a row per token, or
    `output_rows` (a teacher's, which may pad past the tokenizer's tokens)."""
    from transformers import AutoModelForCausalLM

    if args.init:
        model = load_causal_lm(args.init, "--init model", "pass a hub name when online or a local directory")
        try:
            init_tokenizer = load_tokenizer(args.init)
        except InputError:
            init_tokenizer = None  # a checkpoint without tokenizer files: the vocabulary size is all we can check
        check_same_tokenizer(tokenizer, args.init, init_tokenizer, model.config.vocab_size)
        context = getattr(model.config, "max_position_embeddings", None) or getattr(model.config, "n_positions", None)
        if context is not None and args.seq_len > context:
            raise InputError(f"--seq-len {args.seq_len} exceeds {args.init}'s context of {context} tokens; lower it")
        return causal_loss(model)
    arch = family_of(teacher_config) if args.arch == "teacher" and teacher_config is not None else args.arch
    config = model_config(arch, args.n_layer, args.n_head, args.n_kv_head, args.n_embd, output_rows or len(tokenizer),
                          args.seq_len, tokenizer.eos_token_id, args.dropout, teacher_config)
    return causal_loss(AutoModelForCausalLM.from_config(config))


def causal_loss(model):
    """Name the model's loss: transformers cannot tell a causal LM's from the class name GPT2LMHeadModel, and
    warns (`loss_type=None ... unrecognized`) on every run before falling back to that same loss."""
    model.loss_type = model.loss_type or "ForCausalLM"
    return model


def processes():
    """The run's processes (accelerate's PartialState): one, or those `accelerate launch` or torchrun started. On a
    machine without a GPU they talk over gloo; without cpu=True there, each would train alone as process 0."""
    from accelerate import PartialState

    return PartialState(cpu=not torch.cuda.is_available())


def make_accelerator(args: TrainArgs, work_dir: Path):
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration, GradientAccumulationPlugin, ProjectConfiguration

    tracker = JSONLinesTracker(work_dir / "log.jsonl") if args.log_with == "jsonl" else args.log_with
    return Accelerator(
        cpu=not torch.cuda.is_available(),
        mixed_precision="bf16" if args.bf16 else "no",
        # epochs end mid-accumulation; we step only on whole accumulations so resume lines up exactly
        gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=args.grad_accum, sync_with_dataloader=False),
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=args.seed),
        dynamo_backend="inductor" if args.compile else "no",
        log_with=tracker,
        project_config=ProjectConfiguration(project_dir=str(work_dir), logging_dir=str(work_dir)),
    )


def make_optimizer(args: TrainArgs, model) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=args.learning_rate, betas=(0.9, args.adam_beta2), fused=True)


@torch.no_grad()
def validation_loss(accelerator, model, windows: torch.Tensor, batch_size: int) -> float:
    model.eval()
    losses = []
    for batch in windows.split(batch_size):
        batch = batch.to(accelerator.device)
        with accelerator.autocast():
            losses.append(language_model_loss(model, batch)[0].item())
    model.train()
    return float(np.mean(losses))


def save_checkpoint(accelerator, work_dir: Path, step: int, keep: int) -> None:
    root = work_dir / "checkpoints"
    final = root / f"{CHECKPOINT_PREFIX}{step:07d}"
    tmp = root / f".tmp-{final.name}"  # the same name on every process
    accelerator.save_state(str(tmp))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        written.append(final)
        for old in checkpoints(work_dir)[:-keep]:
            shutil.rmtree(old)
            if old in written:  # the interrupt message names what is there
                written.remove(old)
    accelerator.wait_for_everyone()


def save_final(model, tokenizer, args: TrainArgs, metrics: dict) -> None:
    """save_pretrained model + tokenizer + arguments + metrics + the training split's token counts (a draft's
    shortlist of output tokens comes from them, decode --draft-vocab), renamed into place when complete."""
    with atomic_output(args.out, MODEL, overwrite=args.overwrite or args.resume) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "training_args.json").write_text(json.dumps(asdict(args), indent=2) + "\n")
        (tmp / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
        np.save(tmp / TOKEN_COUNTS, token_counts(args.data))


LossFn = Callable[[torch.nn.Module, torch.Tensor], tuple[torch.Tensor, dict]]


@dataclass
class Run:
    args: TrainArgs
    work_dir: Path
    accelerator: "Accelerator"  # noqa: F821
    tokenizer: object
    train_tokens: np.ndarray
    val_tokens: np.ndarray




def keep_freed_memory() -> None:
    """Have glibc's malloc keep freed memory for the process's next allocations. By default it maps each block
    over 32 MB afresh and unmaps it when freed, so every such tensor (a batch's activations, a student's 16 x 512
    x 8192 logits and their gradient) is zeroed and page-faulted in by the kernel at first touch, each time; on 2
    AVX2 cores that cost a distillation step a quarter of its time. PyTorch's CPU tuning guide swaps in jemalloc
    or tcmalloc for the same reason; these two settings of the C library reach it without one. Elsewhere the C
    library's allocator is left as it is."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return
    libc = ctypes.CDLL(None)
    M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # malloc.h
    libc.mallopt(M_MMAP_MAX, 0)  # large blocks come from the heap, which keeps them when freed ...
    libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1)  # ... up to 2 GB free at its top before it shrinks


def start_run(args: TrainArgs) -> Run:
    """Check the compiler, the output and the data, load the data's tokenizer, seed, keep freed memory, and make
    the accelerator."""
    from accelerate.utils import set_seed

    # torch.compile builds its kernels at the first step: checked before anything is written
    flags = [f"--{name.replace('_', '-')}" for name in ("compile", "compile_loss") if getattr(args, name, False)]
    check_compiler("cuda" if torch.cuda.is_available() else "cpu", flags,
                   f"pass {' '.join(flag + ' False' for flag in flags)}")
    work_dir = check_output(args)
    meta, train_tokens, val_tokens = load_data(args)
    tokenizer = data_tokenizer(args, meta)
    state = processes()
    if args.bf16 is None and args.resume:  # a resumed run keeps its run's choice
        args.bf16 = read_saved_args(work_dir)["bf16"]
    elif args.bf16 is None:  # the calibrated choice for the model's width (train/bf16.py), the first process's for all
        from accelerate.utils import broadcast_object_list

        chosen = [bf16_choice(args.n_embd) if state.is_main_process else None]
        args.bf16, why = broadcast_object_list(chosen)[0]
        if state.is_main_process:
            print(f"bf16 autocast {'on' if args.bf16 else 'off'} ({why}; --bf16 True or False to choose)")
    set_seed(args.seed)
    keep_freed_memory()
    return Run(args, work_dir, make_accelerator(args, work_dir), tokenizer, train_tokens, val_tokens)


def train(run: Run, model, loss_fn: LossFn, final_metrics: Callable | None = None,
          make_windows: Callable[[], torch.utils.data.Dataset | None] | None = None) -> dict:
    """The loop: `loss_fn(model, windows)` returns (loss, extra logs); `final_metrics(model)` adds to the
    metrics saved with the model; `make_windows()`, called once the work directory is ready (it may generate
    into it), returns what replaces the train split's packed windows."""
    from transformers.optimization import get_cosine_with_min_lr_schedule_with_warmup

    args, accelerator, work_dir = run.args, run.accelerator, run.work_dir
    if not args.resume and accelerator.is_main_process:
        start_work_dir(work_dir, args)
    accelerator.wait_for_everyone()
    windows = make_windows() if make_windows else None
    optimizer = make_optimizer(args, model)
    scheduler = get_cosine_with_min_lr_schedule_with_warmup(
        optimizer, args.warmup_steps, args.max_steps, min_lr_rate=args.min_lr_ratio
    )
    if windows is None:
        windows = PackedWindows(run.train_tokens, args.seq_len)
    loader = torch.utils.data.DataLoader(windows, batch_size=args.batch_size, shuffle=True, drop_last=True)
    if len(loader) == 0:
        raise InputError(f"the train split holds fewer than --batch-size {args.batch_size} windows; lower it or prepare more data")
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    accelerator.register_for_checkpointing(scheduler)  # stepped by us, once per optimizer step
    # the same windows however the batch is split over processes
    val_windows = eval_windows(run.val_tokens, args.seq_len, args.eval_batches * args.batch_size * accelerator.num_processes)

    step = 0
    found = checkpoints(work_dir) if args.resume else []  # none: stopped before its first, starts at step 0
    if found:
        latest = found[-1]
        check_checkpoint(latest, accelerator.process_index)
        try:
            accelerator.load_state(str(latest))
        except Exception as err:  # unpickling, safetensors and shape errors of many kinds
            raise InputError(f"cannot resume from {latest}, it is damaged ({first_line(err)}); delete it to resume "
                             f"from the one before, or start over with --overwrite") from None
        step = int(latest.name[len(CHECKPOINT_PREFIX) :])
    accelerator.init_trackers("train", config={k: v for k, v in asdict(args).items() if v is not None})

    stop = min(args.max_steps, args.stop_after_steps or args.max_steps)
    tokens_per_step = args.batch_size * args.seq_len * args.grad_accum * accelerator.num_processes
    metrics, logs, tokens_per_s = {}, {}, None
    if step == 0:
        metrics["val_loss_initial"] = validation_loss(accelerator, accelerator.unwrap_model(model), val_windows, args.batch_size)
        accelerator.log({"val_loss": metrics["val_loss_initial"]}, step=0)
    bar = tqdm(total=stop, initial=step, desc=f"training {Path(args.out).name}", unit="step", disable=not accelerator.is_main_process)
    epoch, skip = divmod(step * args.grad_accum, len(loader))
    started, start_step = time.time(), step
    with DeferredInterrupts() as interrupts:
        while step < stop:
            loader.set_epoch(epoch)
            for windows in accelerator.skip_first_batches(loader, skip) if skip else loader:
                with accelerator.accumulate(model):
                    loss, logs = loss_fn(model, windows)
                    accelerator.backward(loss)
                    if accelerator.sync_gradients:
                        accelerator.clip_grad_norm_(model.parameters(), args.grad_clip)
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                if not accelerator.sync_gradients:
                    continue
                scheduler.step()
                step += 1
                tokens_per_s = (step - start_step) * tokens_per_step / (time.time() - started)
                logs = {"loss": loss.item(), "lr": scheduler.get_last_lr()[0], "tokens_per_s": tokens_per_s, **logs}
                if step % args.eval_every == 0 or step == stop:
                    logs["val_loss"] = validation_loss(accelerator, accelerator.unwrap_model(model), val_windows, args.batch_size)
                accelerator.log(logs, step=step)
                bar.set_postfix({k: f"{v:.3g}" for k, v in logs.items() if k in ("loss", "val_loss", "tokens_per_s")}, refresh=False)
                bar.update(1)
                stopping = step < stop and interrupts.requested(accelerator)  # the last step: the run ends anyway
                if (args.save_every and step % args.save_every == 0) or step == stop or stopping:
                    save_checkpoint(accelerator, work_dir, step, args.keep_checkpoints)
                if stopping:
                    bar.close()
                    if accelerator.is_main_process:
                        print(f"stopped at step {step} of {stop}, saved: the same command with --resume continues "
                              f"from it", file=sys.stderr)
                    raise interrupts.stop()
                if step >= stop:
                    break
            epoch, skip = epoch + 1, 0
    bar.close()
    if "val_loss" not in logs:  # resumed after the last step: nothing was trained in this process
        logs["val_loss"] = validation_loss(accelerator, accelerator.unwrap_model(model), val_windows, args.batch_size)
    metrics.update(step=step, val_loss=logs["val_loss"], tokens_per_s=tokens_per_s,
                   seconds=time.time() - started, parameters=sum(p.numel() for p in accelerator.unwrap_model(model).parameters()))
    if step == args.max_steps:
        unwrapped = accelerator.unwrap_model(model)
        if final_metrics is not None:
            metrics.update(final_metrics(unwrapped))
        if accelerator.is_main_process:
            save_final(unwrapped, run.tokenizer, args, metrics)
    accelerator.end_training()
    return metrics


def report(args: TrainArgs, metrics: dict) -> None:
    if not processes().is_main_process:
        return
    done = metrics["step"] == args.max_steps
    where = f"saved to {args.out}" if done else f"stopped at step {metrics['step']} of {args.max_steps}; continue with --resume"
    summary = ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in metrics.items())
    print(f"{where}\n  {summary}")
    if not math.isfinite(metrics.get("val_loss") or 0.0):
        print("  warning: the validation loss is not finite; lower --learning-rate")
