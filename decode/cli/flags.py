"""The flags every tool that builds a decoder shares (decode.run, decode.serve, the benchmarks), and how they become
DecoderOptions: the flags parsed and resolved as the library resolves its arguments (decode.resolution)."""
import argparse
import functools
import sys
from pathlib import Path

from decode.errors import InputError
from decode.methods import METHODS
from decode.models.pretrained import model_dir
from decode.models.precision import PINNED
from decode.options import CPU_BUDGET, CPU_WIDTHS, PAPER_BUDGET, PAPER_WIDTHS, DecoderOptions
from decode.plan_file import CPU_CHAIN, CPU_SAMPLED_CHAIN, describe, replan_command
from decode.resolution import Resolved, resolve
from decode.sampling import Sampling

# Flags a plan fills in unless typed: their parser default is None, DecoderOptions holds the value used otherwise
PLANNED_FLAGS = ("k", "budget", "depth", "widths", "branch", "draft_calls", "lookup_tokens", "draft_dtype", "draft_vocab")
OTHER_FLAGS = ("oracle", "draft", "ngram", "method", "tree_children", "context_drafter", "lookup_branches",
               "lookup_ngram", "dtype", "device", "backend", "cuda_graphs", "token_healing")


@functools.cache
def announce(line: str) -> None:
    """`line` on stderr, once per process however many decoders the tool builds."""
    print(line, file=sys.stderr)


def add_decoder_flags(p: argparse.ArgumentParser) -> None:
    """The flags that choose the models, the method, its tree and the precision."""
    p.add_argument("--run", type=Path, help="run directory: defaults --oracle, --draft, --ngram and --prompts to its parts")
    p.add_argument("--oracle", type=Path, help="the oracle: a directory (save_pretrained) or a hub name (gpt2-large)")
    p.add_argument("--draft", type=Path, help="the draft (for speculative methods): a directory or a hub name")
    p.add_argument("--ngram", type=Path, help="the Katz trigram's directory (for n-gram drafting)")
    p.add_argument("--method", choices=list(METHODS), default="staged",
                   help="; ".join(f"{name}: {m.summary}" for name, m in METHODS.items()))
    p.add_argument("--k", type=int, help="speculative: tokens the draft proposes per oracle call (default: the plan's, else 4)")
    p.add_argument("--budget", type=int,
                   help=f"tree methods: nodes in the oracle's tree (default: the plan's; without one {CPU_BUDGET} on a CPU, "
                        f"{PAPER_BUDGET} on a GPU; unplanned staged on a CPU drafts the draft's chain of {CPU_CHAIN} tokens, "
                        f"{CPU_SAMPLED_CHAIN} when sampling, unless a tree flag is typed)")
    p.add_argument("--depth", type=int, help="tree methods: deepest drafted level (default: the plan's, else 8)")
    p.add_argument("--widths",
                   help=f"staged/ngram: trigram children per node at each level (default: the plan's; without one "
                        f"{','.join(map(str, CPU_WIDTHS))} on a CPU, the paper's {','.join(map(str, PAPER_WIDTHS))} on a GPU)")
    p.add_argument("--paper-tree", action="store_true",
                   help=f"staged/ngram: the paper's tree, --widths {','.join(map(str, PAPER_WIDTHS))} --budget {PAPER_BUDGET} "
                        "(sized for a GPU: the draft scores up to 1,441 nodes a step)")
    p.add_argument("--branch", type=int,
                   help="tree: children per expanded node (default 4); staged: the draft's own top children per node "
                        "(default 1, its argmax), or with sampled --tree-children its draws per node (default 2)")
    p.add_argument("--draft-calls", type=int,
                   help="staged, greedy or top children: the most draft forwards a step makes; past the first, each "
                        "carries the draft's own best path through the tree on towards --depth, the trigram's tree "
                        "below it (default: the plan's, else 1)")
    p.add_argument("--tree-children", choices=["top", "sampled"], default="sampled",
                   help="tree, staged, when sampling (greedy decoding always takes the draft's top tokens): the draft's "
                        "top tokens, verified by sample-match (the same seed gives the baseline's very tokens), or draws "
                        "from it, verified by multi-draft rejection (more tokens per call); a planned tree then draws as "
                        "many children per node as its shape gives it")
    p.add_argument("--context-drafter", action=argparse.BooleanOptionalAction, default=True,
                   help="staged: graft onto the trigram's tree the tokens that followed earlier occurrences of the "
                        "sequence's current suffix (what the lookup method drafts); the draft ranks them with the rest")
    p.add_argument("--lookup-tokens", type=int,
                   help="lookup: tokens per continuation (staged: at most --depth) (default: the plan's, else 10)")
    p.add_argument("--lookup-branches", type=int, default=1, help="lookup, staged: continuations from different earlier occurrences")
    p.add_argument("--lookup-ngram", type=int, default=3, help="lookup, staged: longest suffix matched in the context")
    p.add_argument("--plan", type=Path,
                   help="a plan written by decode.plan: its policy for the method (k, tree shape, budget, widths, lookup "
                        "tokens, draft vocabulary and dtype) fills in those flags that you do not type (default: the run's plan "
                        "for the sampling setting, RUN/plan.json when greedy and e.g. RUN/plan-t1-k50-p1.json at "
                        "--temperature 1 --top-k 50, when it exists and was planned for this device, dtype and backend; a "
                        "plan for other models is refused)")
    p.add_argument("--no-plan", action="store_true", help="use the flags' defaults even when the run has a plan")
    p.add_argument("--token-healing", action=argparse.BooleanOptionalAction, default=True,
                   help="back off the prompt's last token and let the first new token be only one that extends its text "
                        "(a prompt ending in a bare newline otherwise starts where training never went); every method alike")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                   help="auto: the dtype RUN/plan.json was planned in on this device; else on a CPU the one the oracle's "
                        "forward measures faster in (timed once, then cached), on a GPU bfloat16")
    p.add_argument("--draft-dtype", choices=["float32", "bfloat16"],
                   help="the draft's dtype (default: the plan's choice, else --dtype's): a draft's forward of a few rows "
                        "is per-call overhead, which differs by dtype on a CPU")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--backend", choices=["auto", "lean", "hf"], default="auto",
                   help="lean: our GPT-2 engine; hf: any transformers causal LM; auto: lean where it applies")
    p.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=True,
                   help="the lean engine on a GPU: replay each forward as a CUDA graph, one launch instead of a dozen "
                        "kernels per layer (a CPU ignores it)")
    p.add_argument("--draft-vocab", type=int, metavar="N",
                   help="the draft's output layer over its N most frequent training tokens only (RUN/draft/"
                        "token_counts.npy): a fraction of its cost; it then proposes only those, and the output stays "
                        "the oracle's (default: the plan's choice, else 0: every token)")


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
    typed = frozenset(name for name in PLANNED_FLAGS if getattr(args, name) is not None)
    try:
        resolved = resolve({name: getattr(args, name) for name in OTHER_FLAGS + tuple(typed)}, typed, run,
                           plan=args.plan, plans=not args.no_plan, calibrate=not dtype_from_plan)
    except InputError as err:
        p.error(str(err))
    base = resolved.base
    if resolved.dtype_reason is not None and PINNED not in resolved.dtype_reason:  # pinned: the user chose it
        announce(f"dtype: {base.dtype} ({resolved.dtype_reason}; --dtype float32 or bfloat16 to choose)")
    if (borrowed := resolved.borrowed(sampling)) is not None:
        announce(f"note: no plan for this setting in {run}; using {borrowed}")
    if (reason := resolved.without_plan(sampling)) is not None:
        announce(f"note: {reason}, so {base.method} uses {resolved.unplanned(sampling)}; `{replan_command(run, base, sampling)}` "
                 f"plans each method for these models")
    return resolved


def announce_plan(options: DecoderOptions) -> None:
    """Which plan's policy a decoder uses, and how to decode without it."""
    if options.plan is not None and options.policy is not None:
        announce(f"plan {options.plan}: {options.method} with {describe(options.policy)} (a flag you type wins; "
                 "--no-plan for the flags' defaults)")
