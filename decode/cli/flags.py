"""The flags every tool that builds a decoder shares (decode.run, decode.serve, the benchmarks), and how they become
DecoderOptions: the flags parsed and resolved as the library resolves its arguments (decode.resolution)."""
import argparse
import functools
import sys
from dataclasses import fields
from pathlib import Path

from decode.devices import GPU
from decode.errors import InputError
from decode.methods import METHODS
from decode.models.precision import PINNED
from decode.models.pretrained import model_dir
from decode.options import PAPER_BUDGET, PAPER_WIDTHS, DecoderOptions
from decode.plan_file import describe
from decode.planning.concurrency import MOST_SEQUENCES
from decode.resolution import Resolved, resolve
from decode.sampling import Sampling

# The flags that are DecoderOptions fields (decode.options.setting): a planned one's parser default is None (the plan
# fills it in unless typed; DecoderOptions holds the value used otherwise); --plan goes to the resolution on its own
FIELDS = [f for f in fields(DecoderOptions) if "help" in f.metadata]
PLANNED_FLAGS = tuple(f.name for f in FIELDS if f.metadata["planned"])
OTHER_FLAGS = tuple(f.name for f in FIELDS if not f.metadata["planned"] and f.name != "plan")


@functools.cache
def announce(line: str) -> None:
    """`line` on stderr, once per process however many decoders the tool builds."""
    print(line, file=sys.stderr)


def check_ranges(p: argparse.ArgumentParser, ranges: list[tuple[str, float | None, float, float | None]]) -> None:
    """A usage error (exit 2) naming the first flag whose value lies outside its range, given as (flag, value, low,
    high): high None for no upper bound, value None for a flag left unset."""
    for flag, value, low, high in ranges:
        if value is not None and not (low <= value and (high is None or value <= high)):
            p.error(f"{flag} {value} is out of range: use {low}..{high}" if high is not None else
                    f"{flag} must be at least {low} (got {value})")


def add_decoder_flags(p: argparse.ArgumentParser) -> None:
    """The flags that choose the models, the method, its tree and the precision: one per DecoderOptions field, with
    its help (decode.options.setting), and the few that stand for several fields."""
    p.add_argument("--run", type=Path, help="run directory: defaults --oracle, --draft, --ngram and --prompts to its parts")
    for f in FIELDS:
        flag = dict(f.metadata["flag"])
        if f.name == "method":
            flag["choices"] = list(METHODS)
            help = ("; ".join(f"{name}: {m.summary}" for name, m in METHODS.items())
                    + f" (default: staged; without a plan on a GPU when sampling, {GPU.sampled_method})")
        else:
            help = f.metadata["help"]
        if f.metadata["planned"] and f.default is not None and "default" not in help:
            help += f" (default: the plan's, else {f.default})"
        unset = f.metadata["planned"] or f.name == "method"  # None: not typed, which the plan or device decides
        p.add_argument(f"--{f.name.replace('_', '-')}", default=None if unset else f.default, help=help, **flag)
    p.add_argument("--paper-tree", action="store_true",
                   help=f"staged/ngram: the paper's tree, --widths {','.join(map(str, PAPER_WIDTHS))} --budget {PAPER_BUDGET} "
                        "(sized for a GPU: the draft scores up to 1,441 nodes a step)")
    p.add_argument("--no-plan", action="store_true", help="use the flags' defaults even when the run has a plan")


def decoder_flags(p: argparse.ArgumentParser, args: argparse.Namespace, sampling: Sampling,
                  dtype_from_plan: bool = True) -> Resolved:
    """The flags `add_decoder_flags` parsed, resolved (decode.resolution): the run's parts, the tree, the dtype and
    the run's plan for `sampling` (plan_name); `.options(sampling, method)` gives a method's options. `--dtype auto`
    takes the run's plan's dtype (even with --no-plan, so that a benchmark's methods share one) unless
    `dtype_from_plan` is off (the planner, which measures afresh)."""
    run = args.run
    args.oracle = args.oracle and model_dir(args.oracle, "--oracle")  # a hub name typed: its files in the hub's cache
    args.draft = args.draft and model_dir(args.draft, "--draft")
    if args.oracle is None and run is None:
        p.error("pass --oracle DIR (or --run RUN)")
    if args.paper_tree:
        if args.widths is not None or args.budget is not None:
            p.error("--paper-tree sets --widths and --budget; pass either, not both")
        args.widths, args.budget = ",".join(map(str, PAPER_WIDTHS)), PAPER_BUDGET
    if args.widths is not None:
        try:
            args.widths = [int(w) for w in args.widths.split(",")]
        except ValueError:
            p.error(f"--widths takes comma-separated integers, e.g. 3,2,1 (got {args.widths!r})")
    typed = frozenset(name for name in PLANNED_FLAGS + ("method",) if getattr(args, name) is not None)
    named = {name: getattr(args, name) for name in OTHER_FLAGS + tuple(typed) if getattr(args, name) is not None}
    try:
        resolved = resolve(named, typed, run,
                           plan=args.plan, plans=not args.no_plan, calibrate=not dtype_from_plan)
    except InputError as err:
        p.error(str(err))
    base = resolved.base
    if resolved.dtype_reason is not None and PINNED not in resolved.dtype_reason:  # pinned: the user chose it
        announce(f"dtype: {base.dtype} ({resolved.dtype_reason}; --dtype float32 or bfloat16 to choose)")
    for note in resolved.notes(sampling):
        announce(f"note: {note}")
    return resolved


def announce_plan(options: DecoderOptions) -> None:
    """Which plan's policy a decoder uses, and how to decode without it."""
    if options.plan is not None and options.policy is not None:
        announce(f"plan {options.plan}: {options.method} with {describe(options.policy)} (a flag you type wins; "
                 "--no-plan for the flags' defaults)")


def levels(text: str) -> tuple[int, ...]:
    """A --concurrency value: numbers of requests in flight at once, comma-separated, each 1..MOST_SEQUENCES."""
    try:
        counts = tuple(sorted({int(n) for n in text.split(",")}))
    except ValueError:
        counts = (0,)
    if not all(1 <= n <= MOST_SEQUENCES for n in counts):
        raise argparse.ArgumentTypeError(f"{text!r}: give numbers of requests from 1 to {MOST_SEQUENCES}, comma-separated")
    return counts
