"""What a decoder is built from (`DecoderOptions`), and the checks that turn bad settings into one-line errors."""
import math
import numbers
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from decode.errors import InputError
from decode.models.precision import auto_dtype
from decode.tree import Shape
from decode.sampling import Sampling

MAX_BUDGET, MAX_DEPTH = 512, 64
MIN_DRAFT_VOCAB = 64  # a shortlist holds every draft's top children and a sampled proposal's 64 tokens
MIN_TEMPERATURE = 1e-4  # the least sampling temperature: logits divided by a smaller one can overflow float32
PAPER_WIDTHS, PAPER_BUDGET = (12, 7, 4, 1, 1, 1), 36  # the paper's staged tree, sized for a GPU
# Without a plan on a CPU: the trigram widths and budget that plans choose for the cpu preset there. The paper's tree
# has the draft score up to 1,441 nodes a step, which on a CPU is slower than plain decoding (docs/decoding.md).
CPU_WIDTHS, CPU_BUDGET = (3, 2, 1), 12


def default_tree(device: str) -> tuple[int, list[int]]:
    """The oracle's tree budget and the trigram's widths without a plan: sized for a CPU there, the paper's on a GPU."""
    if torch.device(device).type == "cpu":
        return CPU_BUDGET, list(CPU_WIDTHS)
    return PAPER_BUDGET, list(PAPER_WIDTHS)


@dataclass
class DecoderOptions:
    """What a decoder is built from: the models, the method and its tree, the precision. decode.run's flags of the
    same names; a plan's policy (decode.plan_file.with_plan) fills in the tree fields."""

    oracle: Path
    draft: Path | None = None
    ngram: Path | None = None
    method: str = "staged"
    k: int = 4
    budget: int | None = None  # None: sized for the device (default_tree)
    depth: int = 8
    widths: list[int] | None = None  # None: sized for the device
    branch: int | None = None  # None: the drafter's default (tree: 4; staged: 1 top child, or 2 draws when sampled)
    draft_calls: int = 1  # staged: the most draft calls a step makes to carry the draft's best path down to `depth`
    tree_children: str = "sampled"  # when sampling: draws from the draft, or its top tokens (greedy: top, either way)
    tree_shape: Shape | None = None  # the tree method's planned tree (decode.plan) in place of a best-first tree
    context_drafter: bool = True
    lookup_tokens: int = 10
    lookup_branches: int = 1
    lookup_ngram: int = 3
    dtype: str = "auto"  # auto: bfloat16 where the device multiplies in it faster (decode.models.precision)
    draft_dtype: str | None = None  # None: the oracle's dtype
    device: str = "cpu"
    backend: str = "auto"
    cuda_graphs: bool = True  # the lean engine on a GPU: replay each forward's kernels as one graph (a CPU ignores it)
    draft_vocab: int = 0  # the draft's logits over its N most frequent training tokens only (0: every token)
    token_healing: bool = True
    plan: Path | None = None  # the plan whose policy the tree fields hold (None: none)
    policy: dict | None = None  # that policy, as applied

    def check(self) -> "DecoderOptions":
        """Settings that cannot work, as InputError; returns the options with the device's tree and dtype in place
        of None and auto. The method-dependent checks are decode.methods' (check_options, check_tree_shape)."""
        if self.dtype not in ("auto", "float32", "bfloat16"):
            raise InputError(f"dtype must be auto, float32 or bfloat16 (got {self.dtype!r})")
        if self.draft_dtype not in (None, "float32", "bfloat16"):
            raise InputError(f"draft_dtype must be float32 or bfloat16 (got {self.draft_dtype!r})")
        if self.backend not in ("auto", "lean", "hf"):
            raise InputError(f"backend must be auto, lean or hf (got {self.backend!r})")
        if self.tree_children not in ("top", "sampled"):
            raise InputError(f"tree_children must be top or sampled (got {self.tree_children!r})")
        if self.k < 0:
            raise InputError(f"--k must be at least 0 (got {self.k})")
        if min(self.lookup_tokens, self.lookup_branches, self.lookup_ngram) < 1 or self.lookup_tokens > MAX_DEPTH:
            raise InputError(f"--lookup-tokens (1 to {MAX_DEPTH}), --lookup-branches and --lookup-ngram must be at least 1")
        if self.draft_vocab != 0 and self.draft_vocab < MIN_DRAFT_VOCAB:
            raise InputError(f"--draft-vocab {self.draft_vocab}: use 0 (the whole vocabulary) or at least {MIN_DRAFT_VOCAB} tokens")
        check_device(self.device)
        budget, widths = default_tree(self.device)
        dtype = self.dtype if self.dtype != "auto" else auto_dtype(self.device, None, self.oracle)[0]
        return replace(self, budget=budget if self.budget is None else self.budget,
                       widths=list(widths if self.widths is None else self.widths), dtype=dtype)


def check_number(name: str, value, integer: bool = False) -> None:
    """`value` is a number (an integer with `integer`), as InputError: a string or None would fail deep inside."""
    kind = numbers.Integral if integer else numbers.Real
    if not isinstance(value, kind) or isinstance(value, bool):
        raise InputError(f"{name} must be {'an integer' if integer else 'a number'} (got {value!r})", name)


def sampling_of(temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0) -> Sampling:
    """The processed distribution's settings, checked (temperature 0: greedy). A temperature under MIN_TEMPERATURE
    would divide float32 logits past their range."""
    check_number("temperature", temperature)
    check_number("top_k", top_k, integer=True)
    check_number("top_p", top_p)
    if not (temperature == 0 or MIN_TEMPERATURE <= temperature < math.inf):
        raise InputError(f"temperature must be 0 (greedy) or a finite number of at least {MIN_TEMPERATURE} "
                         f"(got {temperature})", "temperature")
    if top_k < 0:
        raise InputError(f"top-k must be at least 0, 0 for every token (got {top_k})", "top_k")
    if not 0 < top_p <= 1:
        raise InputError(f"top-p must lie in (0, 1] (got {top_p})", "top_p")
    return Sampling(temperature, top_k, top_p)


def check_device(device: str) -> None:
    """cpu, or cuda[:N] on a machine that has it."""
    try:
        parsed = torch.device(device)
    except RuntimeError:
        parsed = None
    if parsed is None or parsed.type not in ("cpu", "cuda"):
        raise InputError(f"unknown --device {device!r}; use cpu or cuda (cuda:N for the N-th GPU)")
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            raise InputError(f"--device {device}: this machine has no CUDA device (or torch was built without CUDA); use --device cpu")
        if parsed.index is not None and parsed.index >= torch.cuda.device_count():
            raise InputError(f"--device {device}: there are only {torch.cuda.device_count()} CUDA devices")
