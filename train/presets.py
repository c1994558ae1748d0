"""Training arguments and presets. Every field can be overridden on the command line:

    accelerate launch train/finetune_oracle.py --preset cpu --max-steps 500 --data RUN/data

The preset fills in the defaults, HfArgumentParser reads the command line over them.
"""
import argparse
import dataclasses
import math
import sys
from dataclasses import dataclass, field

from decode.errors import InputError
from train.architectures import ARCHITECTURES

DIVERGENCES = ("forward", "reverse", "tv")  # --kd-loss: train/distill_draft.py's divergence()


@dataclass
class TrainArgs:
    preset: str = field(default="tiny", metadata={"help": "tiny (seconds, tests), quick (minutes, the quickstart), "
                                                          "cpu (80-120 minutes on 2 AVX-512 cores, oracle and draft), paper (GPT-2-L, GPUs)"})
    data: str = field(default="runs/default/data", metadata={"help": "prepared data directory (python -m data.prepare)"})
    out: str = field(default="runs/default/oracle", metadata={"help": "where the final model goes (save_pretrained layout)"})
    work_dir: str | None = field(default=None, metadata={"help": "checkpoints and logs (default: OUT-train)"})
    init: str | None = field(default=None, metadata={"help": "start from this hub checkpoint or directory instead of a config (e.g. gpt2-large)"})
    arch: str = field(default="gpt2", metadata={"help": "the architecture of a model built from a config: gpt2, or a "
                      "Llama-family one (llama, qwen2, mistral: RMS norms, rotary positions, SwiGLU, grouped-query "
                      "attention) (ignored with --init)"})
    n_layer: int = field(default=2, metadata={"help": "transformer blocks (ignored with --init)"})
    n_head: int = field(default=2, metadata={"help": "attention heads (ignored with --init)"})
    n_embd: int = field(default=64, metadata={"help": "hidden size (ignored with --init)"})
    n_kv_head: int = field(default=0, metadata={"help": "key/value heads of a Llama-family model (0: half of --n-head, "
                           "at least one)"})
    dropout: float = field(default=0.0, metadata={"help": "dropout of a model built from a config"})
    seq_len: int = field(default=64, metadata={"help": "tokens per packed training sequence (and context length of a new model)"})
    batch_size: int = field(default=8, metadata={"help": "sequences per micro-batch and process"})
    grad_accum: int = field(default=1, metadata={"help": "micro-batches per optimizer step"})
    max_steps: int = field(default=60, metadata={"help": "optimizer steps; the learning-rate schedule spans them"})
    stop_after_steps: int | None = field(default=None, metadata={"help": "checkpoint and stop at this step (continue later with --resume)"})
    learning_rate: float = field(default=3e-3, metadata={"help": "peak learning rate"})
    min_lr_ratio: float = field(default=0.1, metadata={"help": "cosine decay ends at this fraction of the peak"})
    warmup_steps: int = field(default=10, metadata={"help": "linear warm-up steps"})
    weight_decay: float = field(default=0.1, metadata={"help": "AdamW weight decay (matrices only)"})
    adam_beta2: float = field(default=0.95, metadata={"help": "AdamW beta2"})
    grad_clip: float = field(default=1.0, metadata={"help": "clip the gradient norm to this"})
    eval_every: int = field(default=20, metadata={"help": "validation loss every N steps"})
    eval_batches: int = field(default=4, metadata={"help": "micro-batches of validation windows per evaluation"})
    save_every: int = field(default=0, metadata={"help": "checkpoint every N steps (0: at the end only)"})
    keep_checkpoints: int = field(default=2, metadata={"help": "checkpoints kept in the work directory"})
    bf16: bool | None = field(default=False, metadata={"help": "bf16 autocast: True, False, or unset (the quick, cpu and "
                                 "paper presets): on where it measures faster than float32 (GPUs with bf16, CPUs with AMX or "
                                 "AVX-512 BF16; a CPU with AVX2 alone emulates it, several times slower)"})
    compile: bool = field(default=False, metadata={"help": "torch.compile the model (inductor)"})
    seed: int = field(default=0, metadata={"help": "seed of initialisation, data order and dropout"})
    log_with: str = field(default="jsonl", metadata={"help": "accelerate tracker: jsonl (offline) or tensorboard"})
    resume: bool = field(default=False, metadata={"help": "continue from the newest checkpoint in the work directory"})
    overwrite: bool = field(default=False, metadata={"help": "replace a previous run in OUT and the work directory"})

    def check(self) -> None:
        """Values no run can use, as one-line InputErrors, before anything is written."""
        if self.n_kv_head < 0:
            raise InputError(f"--n-kv-head must be 0 (half of --n-head) or more (got {self.n_kv_head})")
        for name in ("n_layer", "n_head", "n_embd", "seq_len", "batch_size", "grad_accum", "eval_every", "eval_batches",
                     "keep_checkpoints"):
            if getattr(self, name) < 1:
                raise InputError(f"--{name.replace('_', '-')} must be at least 1 (got {getattr(self, name)})")
        if not 0 <= self.warmup_steps < self.max_steps:
            raise InputError(f"--max-steps {self.max_steps} must be positive and above --warmup-steps {self.warmup_steps}")
        if self.save_every < 0:
            raise InputError(f"--save-every must be 0 (at the end only) or more (got {self.save_every})")
        if self.stop_after_steps is not None and self.stop_after_steps < 1:
            raise InputError(f"--stop-after-steps must be at least 1 (got {self.stop_after_steps})")
        if not 0 < self.learning_rate < math.inf or not 0 < self.grad_clip < math.inf:
            raise InputError(f"--learning-rate and --grad-clip must be positive and finite "
                             f"(got {self.learning_rate}, {self.grad_clip})")
        if not (0 <= self.min_lr_ratio <= 1 and 0 <= self.adam_beta2 < 1 and 0 <= self.dropout < 1
                and 0 <= self.weight_decay < math.inf):
            raise InputError("--min-lr-ratio must lie in [0, 1], --adam-beta2 and --dropout in [0, 1), "
                             "--weight-decay be 0 or positive")
        if self.arch not in (*ARCHITECTURES, *(("teacher",) if isinstance(self, DistillArgs) else ())):
            raise InputError(f"--arch {self.arch!r}: choose one of {', '.join(ARCHITECTURES)}"
                             f"{' or teacher' if isinstance(self, DistillArgs) else ''}")
        if self.log_with not in ("jsonl", "tensorboard"):
            raise InputError(f"--log-with {self.log_with!r}: choose jsonl or tensorboard")


@dataclass
class DistillArgs(TrainArgs):
    arch: str = field(default="teacher", metadata={"help": "the student's architecture: teacher (the teacher's "
                      "family: a Llama-family draft for a Llama-family oracle, else GPT-2), gpt2, llama, qwen2 or mistral"})
    draft_shape: str = field(default="fit", metadata={"help": "LAYERSxWIDTH (e.g. 2x128): the student's --n-layer and "
                             "--n-embd at once, with heads of 64 (one head below 64 wide); fit: the preset's layers and its "
                             "width scaled by the teacher's width over that of the oracle the preset was sized for (quick "
                             "256, cpu 512, paper 1280), to a multiple of 64; preset: the preset's shape as it is. A typed "
                             "--n-layer, --n-head or --n-embd keeps the preset's shape otherwise"})
    teacher: str = field(default="runs/default/oracle", metadata={"help": "the frozen teacher (the oracle's directory)"})
    kd_weight: float = field(default=0.8, metadata={"help": "weight of the divergence to the teacher; cross-entropy gets 1 - kd_weight"})
    kd_loss: str = field(default="forward", metadata={"help": "the divergence: forward (KL(teacher || student)), reverse "
                         "(KL(student || teacher)) or tv (total variation, one minus the acceptance rate of speculative sampling)"})
    kd_temperature: float = field(default=1.0, metadata={"help": "softening temperature of both distributions in the divergence"})
    agreement_batches: int = field(default=16, metadata={"help": "validation micro-batches for the final agreement report"})
    teacher_windows: float = field(default=0.0, metadata={"help": "share of training windows whose last --continuation-tokens "
                                   "the teacher wrote (its continuation of a --teacher-prefixes prefix, generated once before training): the "
                                   "draft then sees the oracle's own output, as when decoding; 0: corpus windows only"})
    teacher_prefixes: str = field(default="corpus", metadata={"help": "what the teacher continues: corpus (random windows "
                                  "of the training split) or prompts (a function's signature and docstring, harvested from "
                                  "the training split's files, as decoding gets them)"})
    continuation_tokens: int = field(default=32, metadata={"help": "tokens the teacher writes at the end of each teacher window"})
    continuation_temperature: float = field(default=0.0, metadata={"help": "the teacher's sampling temperature for those "
                                            "tokens (0: greedy, what greedy decoding sees)"})
    sparse_targets: int = field(default=0, metadata={"help": "K > 0: compute the teacher's K most probable next tokens and their "
                                "log-probabilities once, over a fixed set of windows, and train on those (train/teacher_targets.py); "
                                "0: run the teacher at every step (dense)"})
    target_epochs: int = field(default=1, metadata={"help": "with --sparse-targets: passes over the windows whose targets were "
                               "computed (the run draws --max-steps x --batch-size x --grad-accum windows; 1 / this of them are distinct)"})
    targets_from: str = field(default="", metadata={"help": "with --sparse-targets: copy the teacher targets (and teacher "
                              "windows) another distillation run generated, from its work directory (OUT-train), instead of "
                              "computing them again; refused unless that run had the same teacher, data, seed and every "
                              "setting they depend on (to compare student shapes against one teacher at the cost of one)"})
    teacher_embeddings: bool = field(default=False, metadata={"help": "start the student's token and position embeddings "
                                     "from the teacher's, projected onto their --n-embd principal directions (SVD): the "
                                     "student's tied output layer then begins as the best rank --n-embd copy of the teacher's"})
    teacher_layers: bool = field(default=False, metadata={"help": "with --teacher-embeddings: start each of the student's "
                                 "blocks from the teacher's block of the same number, read and written through those principal "
                                 "directions, its heads, head dimensions and MLP units the teacher's first ones (weight selection)"})
    compile_loss: bool = field(default=False, metadata={"help": "torch.compile the teacher's forward and the loss (the "
                               "divergence and the cross-entropy over the whole vocabulary), where a small student's step spends "
                               "most of its time; --compile is the student's own"})

    def check(self) -> None:
        if self.draft_shape not in ("fit", "preset"):
            layers, _, width = self.draft_shape.partition("x")
            if not (layers.isdigit() and width.isdigit() and int(layers) > 0 and int(width) >= 16):
                raise InputError(f"--draft-shape {self.draft_shape!r}: give LAYERSxWIDTH (e.g. 2x128), fit or preset")
            self.n_layer, self.n_embd = int(layers), int(width)
            self.n_head = max(1, self.n_embd // 64)
        super().check()
        if not 0 <= self.kd_weight <= 1 or not 0 < self.kd_temperature < math.inf:
            raise InputError("--kd-weight must lie in [0, 1] and --kd-temperature be positive")
        if self.kd_loss not in DIVERGENCES:
            raise InputError(f"--kd-loss {self.kd_loss!r}: choose one of {', '.join(DIVERGENCES)}")
        if self.teacher_prefixes not in ("corpus", "prompts"):
            raise InputError(f"--teacher-prefixes {self.teacher_prefixes!r}: choose corpus or prompts")
        if not 0 <= self.teacher_windows <= 1 or not 0 <= self.continuation_temperature < math.inf:
            raise InputError("--teacher-windows must lie in [0, 1] and --continuation-temperature be 0 (greedy) or positive")
        if not 0 < self.continuation_tokens < self.seq_len:
            raise InputError(f"--continuation-tokens must lie between 1 and --seq-len - 1 ({self.seq_len - 1})")
        if self.sparse_targets < 0 or self.target_epochs < 1:
            raise InputError("--sparse-targets must be 0 (dense) or a positive number of tokens, --target-epochs at least 1")
        if self.targets_from and not self.sparse_targets:
            raise InputError("--targets-from needs --sparse-targets (dense distillation keeps no targets to copy)")
        if self.teacher_layers and not self.teacher_embeddings:
            raise InputError("--teacher-layers True needs --teacher-embeddings True (the blocks read the stream in their basis)")
        if self.agreement_batches < 1:
            raise InputError(f"--agreement-batches must be at least 1 (got {self.agreement_batches})")


_SHARED = {
    "tiny": {},
    "quick": dict(seq_len=512, bf16=None, compile=True, eval_every=50, eval_batches=4, save_every=50, warmup_steps=20),
    "cpu": dict(seq_len=512, bf16=None, compile=True, eval_every=200, eval_batches=8, save_every=200, warmup_steps=100),
    "paper": dict(seq_len=1024, bf16=None, batch_size=8, grad_accum=8, eval_every=500, eval_batches=32, save_every=1000,
                  warmup_steps=500, data="runs/paper/data"),
}

ORACLE_PRESETS = {
    "tiny": TrainArgs(),
    # about 5M parameters: a few minutes on 2 cores, for the quickstart
    "quick": TrainArgs(**_SHARED["quick"], n_layer=4, n_head=4, n_embd=256, batch_size=8, max_steps=300, learning_rate=2e-3),
    # about 23M parameters with an 8192 vocabulary: its training times are docs/training.md's preset table
    "cpu": TrainArgs(**_SHARED["cpu"], n_layer=6, n_head=8, n_embd=512, batch_size=8, grad_accum=2, max_steps=1300,
                     learning_rate=1e-3),
    "paper": TrainArgs(**_SHARED["paper"], init="gpt2-large", max_steps=10000, learning_rate=5e-5, out="runs/paper/oracle"),
}

DRAFT_PRESETS = {
    "tiny": DistillArgs(out="runs/default/draft"),
    # about 0.6M parameters, 9x smaller than the quick oracle; half its windows end with the oracle's own greedy
    # continuation of a prompt, trained on the total variation distance, its embeddings and block from the teacher's
    # (docs/training.md: each of these raised agreement with the looping quick oracle)
    "quick": DistillArgs(**{**_SHARED["quick"], "compile": False}, out="runs/default/draft", n_layer=1, n_head=2, n_embd=64,
                         batch_size=8, max_steps=150, learning_rate=3e-3, continuation_tokens=128, teacher_windows=0.5,
                         teacher_prefixes="prompts", kd_loss="tv", teacher_embeddings=True, teacher_layers=True,
                         compile_loss=True),
    # about 1.5M parameters, 15x smaller than the cpu oracle (the paper's ratio is 19x); embeddings and blocks from the
    # teacher's; the teacher's top-32 targets over 2,400 windows, computed once, then 1,200 steps of 8192 tokens (8
    # passes over them) with the loss compiled: top-1 agreement 0.71, expected acceptance 0.75 (docs/training.md,
    # "How the cpu recipe was chosen")
    "cpu": DistillArgs(**{**_SHARED["cpu"], "warmup_steps": 20, "compile": False}, out="runs/default/draft", n_layer=2, n_head=4, n_embd=128,
                       batch_size=16, max_steps=1200, learning_rate=2e-3, continuation_tokens=128, sparse_targets=32,
                       target_epochs=8, teacher_embeddings=True, teacher_layers=True, compile_loss=True),
    # about 39M parameters with GPT-2's 50257-token vocabulary
    "paper": DistillArgs(**_SHARED["paper"], out="runs/paper/draft", teacher="runs/paper/oracle", n_layer=4, n_head=8,
                         n_embd=512, max_steps=20000, learning_rate=6e-4, continuation_tokens=128),
}


# The width of the oracle each draft preset's shape was chosen for: `--draft-shape fit` scales its width by a teacher's
# against it (the paper's draft of 512 for GPT-2-Large's 1280; the cpu preset's 128 for its oracle's 512)
SIZED_FOR = {"quick": 256, "cpu": 512, "paper": 1280}


def fitted_shape(args: DistillArgs, teacher_width: int) -> tuple[int, int, int] | None:
    """(layers, heads, width) of the student `--draft-shape fit` gives for a teacher `teacher_width` wide: the preset's
    layers, its width times the teacher's over SIZED_FOR's, to a multiple of 64 (at least 64), heads of 64. None where
    the shape stands as it is: another --draft-shape, a preset sized for no oracle (tiny), a typed --n-layer, --n-head
    or --n-embd, or a width that comes out the preset's own."""
    preset, sized_for = DRAFT_PRESETS.get(args.preset), SIZED_FOR.get(args.preset)
    if args.draft_shape != "fit" or preset is None or sized_for is None:
        return None
    if (args.n_layer, args.n_head, args.n_embd) != (preset.n_layer, preset.n_head, preset.n_embd):
        return None
    width = max(64, 64 * round(preset.n_embd * teacher_width / sized_for / 64))
    return None if width == preset.n_embd else (preset.n_layer, width // 64, width)


def parse_args(args_class, presets: dict, description: str, argv=None, prog: str | None = None):
    """Pick the preset named by --preset, then let HfArgumentParser override any of its fields."""
    from transformers import HfArgumentParser

    argv = sys.argv[1:] if argv is None else list(argv)
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--preset", default="tiny")
    name = pre.parse_known_args(argv)[0].preset
    if name not in presets:
        raise InputError(f"no preset named {name!r}; choose one of: {', '.join(presets)}")
    parser = HfArgumentParser(args_class, description=description, prog=prog)
    for action in parser._actions:  # dashes first, as every other command spells its flags; underscores still parse
        action.option_strings.sort(key=lambda option: "_" in option)
    parser.set_defaults(**dataclasses.asdict(presets[name]))
    (args,) = parser.parse_args_into_dataclasses(args=argv)
    args.check()
    return args
