"""The teacher's top-k next-token distribution over a fixed set of training windows, computed once.

Dense distillation runs the teacher on every step's windows, its forward most of a step's cost when
the student is small. With --sparse-targets K the teacher runs once over the windows the run trains
on, keeping at each position its K most probable tokens and their log-probabilities (softened by
--kd-temperature), and the student makes --target-epochs passes over them: the teacher is paid once
per window instead of once per pass.

The divergence then sees K + 1 outcomes: the K tokens and the rest of the vocabulary as one, with
mass 1 - sum of the K on either side. Merging outcomes never increases an f-divergence (forward KL,
reverse KL, total variation alike), so the sparse value is at most the dense one, equal to it when
the rest holds no teacher mass. The student's log-probabilities are then needed at K + 1 tokens a
position (the K and the next token, for the cross-entropy): `selected_log_probs` reads them without
the dense log-softmax.
"""
import shutil
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from decode.atomic import atomic_output
from decode.errors import InputError
from train.continuations import POOL_FILE
from train.work_dir import changed_args, load_or_build_arrays, read_saved_args

TARGETS_FILE = "teacher_targets.npz"
# what decides the windows a run trains on and the teacher's targets over them (not the student's shape)
TARGETS_DEPEND_ON = ("teacher", "data", "seed", "seq_len", "max_steps", "batch_size", "grad_accum", "teacher_windows",
                     "teacher_prefixes", "continuation_tokens", "continuation_temperature", "sparse_targets",
                     "target_epochs", "kd_temperature")


def check_targets_from(args) -> None:
    """Refuse a --targets-from run whose targets this run would not have computed itself."""
    source = Path(args.targets_from)
    if not (source / TARGETS_FILE).is_file():
        raise InputError(f"--targets-from {source}: no {TARGETS_FILE} there; pass the work directory (OUT-train) of a "
                         f"distillation run with --sparse-targets that got past its teacher targets")
    saved = read_saved_args(source, f"--targets-from {source}", "pass another run's work directory")
    changed = changed_args(saved, args, TARGETS_DEPEND_ON)
    if changed:
        raise InputError(f"--targets-from {source}: that run had different {', '.join('--' + name.replace('_', '-') for name in changed)}, "
                         f"so its targets are not this run's; use the same settings, or drop --targets-from")


def copy_targets(source: Path, work_dir: Path) -> None:
    """Copy the teacher windows and targets a run generated into this run's work directory, where it has none."""
    for name in (POOL_FILE, TARGETS_FILE):
        if (source / name).is_file() and not (work_dir / name).exists():
            with atomic_output(work_dir / name, overwrite=True) as tmp:
                shutil.copyfile(source / name, tmp)


@torch.no_grad()
def top_k_targets(teacher, windows: torch.utils.data.Dataset, k: int, temperature: float, vocab_size: int,
                  batch_size: int, device, autocast) -> dict:
    """For every window (in order) and position: the teacher's k most probable next tokens ("ids", as int32)
    and their log-probabilities at `temperature` ("logp", float16), over the first vocab_size logits. Each batch's
    are written into arrays made once: kept as a tensor a batch between the forwards' large temporaries, they
    fragmented the heap, which then grew with every batch."""
    shape = (len(windows), len(windows[0]), k)
    ids, logp = np.empty(shape, np.int32), np.empty(shape, np.float16)
    for start in tqdm(range(0, len(windows), batch_size), desc="teacher targets", unit="batch"):
        end = min(start + batch_size, len(windows))
        batch = torch.stack([windows[i] for i in range(start, end)]).to(device)
        with autocast():
            logits = teacher(batch).logits.float()[..., :vocab_size]
        top = F.log_softmax(logits / temperature, -1).topk(k, dim=-1)
        ids[start:end] = top.indices.cpu().numpy()
        logp[start:end] = top.values.half().cpu().numpy()
    return {"ids": ids, "logp": logp}


def load_or_build_targets(work_dir: Path, build, count: int, seq_len: int, k: int) -> dict:
    return load_or_build_arrays(work_dir / TARGETS_FILE, build, {"ids": (count, seq_len, k), "logp": (count, seq_len, k)})


class SelectedLogProbs(torch.autograd.Function):
    """log_softmax(logits, -1).gather(-1, columns). Autograd through those two ops keeps the dense
    log-probabilities and, backward, scatters the gradient into a dense zero tensor before the softmax's
    backward; torch.compile's code for that graph took 0.43 s of a 1.2-1.4 s cpu-preset student step on 2 CPU
    cores (16 x 512 x 8192 logits), this 0.1 s. The gradient in one pass: with g the gradient of the selected
    values and s the softmax, d/d logits = scatter(g) - s * sum(g)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
        log_norm = torch.logsumexp(logits, -1, keepdim=True)
        ctx.save_for_backward(logits, columns, log_norm)
        return logits.gather(-1, columns) - log_norm

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        logits, columns, log_norm = ctx.saved_tensors
        dense = (logits - log_norm).exp_().mul_(-grad.sum(-1, keepdim=True))
        # a column chosen twice in a row gets its gradients summed here, and zero from all but its first copy:
        # scatter_add_ then adds at most one nonzero value per logit, so its result does not depend on the order
        # it adds in (on CUDA it adds with atomics, in no fixed order: a resumed run did not repeat itself)
        same = columns[..., :, None] == columns[..., None, :]
        summed = torch.where(same, grad[..., None, :], 0).sum(-1)  # where, not a product: 0 * inf would be nan
        return dense.scatter_add_(-1, columns, torch.where(same.tril(-1).any(-1), 0, summed)), None


def selected_log_probs(logits: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """The log-softmax of `logits` at `columns` (int64, a row of columns per row of logits)."""
    return SelectedLogProbs.apply(logits, columns)


def sparse_terms(logits: torch.Tensor, windows: torch.Tensor, ids: torch.Tensor, teacher_logp: torch.Tensor,
                 temperature: float, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(divergence to the teacher's top-k targets at `temperature`, cross-entropy on the next tokens), from the
    student's logits: its log-probabilities read at the k tokens and the next one only."""
    next_tokens = F.pad(windows[:, 1:], (0, 1))[..., None]  # the last position has no next token: column 0, unread
    if temperature == 1:  # both from one normalisation
        selected = selected_log_probs(logits, torch.cat([ids.long(), next_tokens], -1))
        log_q, log_next = selected[..., :-1], selected[..., -1]
    else:
        log_q = selected_log_probs(logits / temperature, ids.long())
        log_next = selected_log_probs(logits, next_tokens)[..., 0]
    return sparse_divergence(log_q, teacher_logp, kind), -log_next[:, :-1].mean()


def sparse_divergence(log_q: torch.Tensor, teacher_logp: torch.Tensor, kind: str) -> torch.Tensor:
    """Mean over positions of the divergence (forward, reverse, tv as in distill_draft.divergence) between the
    teacher's top-k distribution and the student's, each with the rest of the vocabulary as one more outcome.
    `log_q`: the student's log-probabilities of the teacher's k tokens."""
    p = teacher_logp.float().exp()
    q = log_q.exp()
    p_rest = (1 - p.sum(-1, keepdim=True)).clamp(0, 1)
    q_rest = (1 - q.sum(-1, keepdim=True)).clamp(1e-12, 1)  # rounding can push a sum of probabilities past one
    p, q = torch.cat([p, p_rest], -1), torch.cat([q, q_rest], -1)
    log_p, log_q = torch.cat([teacher_logp.float(), p_rest.clamp_min(1e-12).log()], -1), torch.cat([log_q, q_rest.log()], -1)
    if kind == "forward":
        terms = torch.xlogy(p, p) - p * log_q
    elif kind == "reverse":
        terms = q * (log_q - log_p)
    else:
        terms = 0.5 * (p - q).abs()
    return terms.sum(-1).mean()


class TargetWindows(torch.utils.data.Dataset):
    """Windows with their precomputed targets: items (window, ids, logp)."""

    def __init__(self, windows: torch.utils.data.Dataset, targets: dict):
        self.windows, self.ids, self.logp = windows, targets["ids"], targets["logp"]

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, i: int):
        return self.windows[i], torch.from_numpy(self.ids[i]), torch.from_numpy(self.logp[i])
