"""Decode prompts with the oracle alone or with speculative decoding; same output either way.

    python -m decode.run --run RUN --method speculative --limit 10
    python -m decode.run --oracle RUN/oracle --draft RUN/draft --method baseline --prompt "def add(a, b):"
    python -m decode.run --run RUN --method speculative --temperature 1 --top-k 50 --out out.jsonl
"""
import argparse
import functools
import json
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from data.atomic import FILE, atomic_output, check_output
from data.cli import HelpFormatter
from data.errors import InputError, exits_on_input_error
from data.prompts import load_prompts
from decode.api import METHODS, DecoderOptions, SpeculativeDecoder, drain, sampling_of
from decode.generation import Request
from decode.healing import Prompt
from decode.planning import CPU_BUDGET, CPU_WIDTHS, PAPER_BUDGET, PAPER_WIDTHS, describe, run_plan
from decode.precision import PINNED, auto_dtype
from decode.sampling import Sampling


@dataclass
class Settings:
    """decode.run's flags, parsed and checked: what the other tools share with it."""

    options: DecoderOptions
    sampling: Sampling
    prompt: str | None
    prompts: str | None
    limit: int | None
    max_new_tokens: int
    seed: int
    out: Path | None
    overwrite: bool
    stream: bool
    run: Path | None = None


class Typed(argparse.Action):
    """Stores the flag's value and notes that it was typed (`given`): a plan fills in only the flags not typed."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        namespace.given = namespace.given | {self.dest}


@functools.cache
def announce(line: str) -> None:
    """`line` on stderr, once per process however many decoders the tool builds."""
    print(line, file=sys.stderr)


def add_decoder_flags(p: argparse.ArgumentParser) -> None:
    """The flags that choose the models, the method, its tree and the precision: what every tool that builds a
    decoder shares (decode.run, decode.serve, the benchmarks)."""
    p.add_argument("--run", type=Path, help="run directory: defaults --oracle, --draft, --ngram and --prompts to its parts")
    p.add_argument("--oracle", type=Path, help="the oracle's directory (save_pretrained)")
    p.add_argument("--draft", type=Path, help="the draft's directory (for speculative methods)")
    p.add_argument("--ngram", type=Path, help="the Katz trigram's directory (for n-gram drafting)")
    p.add_argument("--method", choices=METHODS, default="staged",
                   help="baseline: the oracle alone; speculative: chain drafts of --k tokens; tree: draft-model trees; "
                        "staged: trigram (and context) -> draft -> oracle trees; ngram: trigram trees; "
                        "lookup: continuations found in the context (prompt lookup), no model")
    p.add_argument("--k", type=int, default=4, action=Typed, help="speculative: tokens the draft proposes per oracle call")
    p.add_argument("--budget", type=int, default=None, action=Typed,
                   help=f"tree methods: nodes in the oracle's tree (default: the plan's; without one {CPU_BUDGET} on a CPU, "
                        f"{PAPER_BUDGET} on a GPU)")
    p.add_argument("--depth", type=int, default=8, action=Typed, help="tree methods: deepest drafted level")
    p.add_argument("--widths", default=None, action=Typed,
                   help=f"staged/ngram: trigram children per node at each level (default: the plan's; without one "
                        f"{','.join(map(str, CPU_WIDTHS))} on a CPU, the paper's {','.join(map(str, PAPER_WIDTHS))} on a GPU)")
    p.add_argument("--paper-tree", action="store_true",
                   help=f"staged/ngram: the paper's tree, --widths {','.join(map(str, PAPER_WIDTHS))} --budget {PAPER_BUDGET} "
                        "(sized for a GPU: the draft scores up to 1,441 nodes a step)")
    p.add_argument("--branch", type=int, default=None, action=Typed,
                   help="tree: children per expanded node (default 4); staged: the draft's own top children per node "
                        "(default 1, its argmax), or with sampled --tree-children its draws per node (default 2)")
    p.add_argument("--tree-children", choices=["top", "sampled"], default=None,
                   help="tree, staged, when sampling (greedy decoding always takes the draft's top tokens): the draft's "
                        "top tokens, verified by sample-match (the same seed gives the baseline's very tokens), or draws "
                        "from it, verified by multi-draft rejection (more tokens per call) (default: sampled; a planned "
                        "tree then draws as many children per node as its shape gives it)")
    p.add_argument("--context-drafter", action=argparse.BooleanOptionalAction, default=True,
                   help="staged: graft onto the trigram's tree the tokens that followed earlier occurrences of the "
                        "sequence's current suffix (what the lookup method drafts); the draft ranks them with the rest")
    p.add_argument("--lookup-tokens", type=int, default=10, action=Typed,
                   help="lookup: tokens per continuation (staged: at most --depth)")
    p.add_argument("--lookup-branches", type=int, default=1, help="lookup, staged: continuations from different earlier occurrences")
    p.add_argument("--lookup-ngram", type=int, default=3, help="lookup, staged: longest suffix matched in the context")
    p.add_argument("--plan", type=Path,
                   help="a plan written by decode.plan: its policy for the method (k, tree shape, budget, widths, lookup "
                        "tokens, draft vocabulary and dtype) fills in those flags that you do not type (default: RUN/plan.json when it "
                        "exists and was planned for this device, dtype and backend; a plan for other models is refused)")
    p.add_argument("--no-plan", action="store_true", help="use the flags' defaults even when RUN/plan.json exists")
    p.add_argument("--token-healing", action=argparse.BooleanOptionalAction, default=True,
                   help="back off the prompt's last token and let the first new token be only one that extends its text "
                        "(a prompt ending in a bare newline otherwise starts where training never went); every method alike")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                   help="auto: the dtype RUN/plan.json was planned in on this device; else on a CPU the one the oracle's "
                        "forward measures faster in (timed once, then cached), on a GPU bfloat16")
    p.add_argument("--draft-dtype", choices=["float32", "bfloat16"], default=None, action=Typed,
                   help="the draft's dtype (default: the plan's choice, else --dtype's): a draft's forward of a few rows "
                        "is per-call overhead, which differs by dtype on a CPU")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--backend", choices=["auto", "lean", "hf"], default="auto",
                   help="lean: our GPT-2 engine; hf: any transformers causal LM; auto: lean where it applies")
    p.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=True,
                   help="the lean engine on a GPU: replay each forward as a CUDA graph, one launch instead of a dozen "
                        "kernels per layer (a CPU ignores it)")
    p.add_argument("--draft-vocab", type=int, default=0, metavar="N", action=Typed,
                   help="the draft's output layer over its N most frequent training tokens only (RUN/draft/"
                        "token_counts.npy): a fraction of its cost; it then proposes only those, and the output stays "
                        "the oracle's (0: every token; a plan's choice when not typed)")
    p.set_defaults(given=frozenset())


def decoder_options(p: argparse.ArgumentParser, args: argparse.Namespace, dtype_from_plan: bool = True) -> DecoderOptions:
    """The options `add_decoder_flags` parsed, resolved: the run's parts, the tree, the dtype and the run's plan.
    `--dtype auto` takes the run's plan's dtype (even with --no-plan, so that a benchmark's methods share one) unless
    `dtype_from_plan` is off (the planner, which measures afresh)."""
    if args.run is not None:
        args.oracle = args.oracle or args.run / "oracle"
        args.draft = args.draft or args.run / "draft"
        args.ngram = args.ngram or args.run / "ngram"
    if args.no_plan:
        args.plan = None
    if args.oracle is None:
        p.error("pass --oracle DIR (or --run RUN)")
    if args.paper_tree:
        if {"widths", "budget"} & args.given:
            p.error("--paper-tree sets --widths and --budget; pass either, not both")
        args.widths, args.budget = ",".join(map(str, PAPER_WIDTHS)), PAPER_BUDGET
        args.given = args.given | {"widths", "budget"}
    if args.widths is not None:
        try:
            args.widths = [int(w) for w in args.widths.split(",")]
        except ValueError:
            p.error(f"--widths takes comma-separated integers, e.g. 3,2,1 (got {args.widths!r})")
    if args.dtype == "auto":
        plan = args.plan or (args.run / "plan.json" if args.run is not None else None)
        args.dtype, why = auto_dtype(args.device, plan if dtype_from_plan else None, args.oracle)
        if PINNED not in why:  # pinned by the environment: the user chose it
            announce(f"dtype: {args.dtype} ({why}; --dtype float32 or bfloat16 to choose)")
    try:
        options = DecoderOptions.of(args).check()
    except InputError as err:
        p.error(str(err))
    if args.run is not None and args.plan is None and not args.no_plan:
        options = replace(options, plan=run_plan(args.run, options))
    return options


def parse(argv=None, prog: str = "python -m decode.run", description: str = __doc__.split("\n\n")[0],
          dtype_from_plan: bool = True) -> Settings:
    """decode.run's flags as Settings; the tools built on them (profile_step) pass their own name and summary, and the
    planner `dtype_from_plan=False` (decoder_options)."""
    p = argparse.ArgumentParser(prog=prog, description=description, formatter_class=HelpFormatter)
    add_decoder_flags(p)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="one prompt text")
    src.add_argument("--prompts", help="'humaneval' or a .jsonl[.gz] file of {task_id, prompt} (default: RUN/prompts.jsonl)")
    p.add_argument("--limit", type=int, help="the first N prompts")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate per prompt")
    p.add_argument("--temperature", type=float, default=0.0, help="0 means greedy")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0: all)")
    p.add_argument("--top-p", type=float, default=1.0, help="keep the smallest set with this much probability")
    p.add_argument("--seed", type=int, default=0, help="the first prompt's sampling seed; prompt i takes seed + i")
    p.add_argument("--out", type=Path, help="write one JSON object per prompt here (.jsonl)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    p.add_argument("--stream", action="store_true", help="print each completion as its tokens are accepted")
    args = p.parse_args(argv)
    if args.run is not None and args.prompt is None and args.prompts is None:
        args.prompts = str(args.run / "prompts.jsonl")
    if args.prompt is None and args.prompts is None:
        p.error("pass --prompt TEXT or --prompts humaneval|FILE (or --run RUN)")
    if args.limit is not None and args.limit < 1:
        p.error(f"--limit must be at least 1 (got {args.limit}); leave it out for every prompt")
    options = decoder_options(p, args, dtype_from_plan)
    try:
        sampling = sampling_of(args.temperature, args.top_k, args.top_p)
    except InputError as err:
        p.error(str(err))
    return Settings(options, sampling, args.prompt, args.prompts, args.limit, args.max_new_tokens, args.seed,
                    args.out, args.overwrite, args.stream, args.run)


def encode_prompts(settings: Settings, decoders: list[SpeculativeDecoder], records: list[dict] | None = None
                   ) -> list[tuple[dict, Prompt]]:
    """The prompts (`records`, or the settings'), checked to fit every decoder's context with its
    lookahead, healed as the first decodes them."""
    if records is None and settings.prompt is not None:
        records = [{"task_id": "prompt", "prompt": settings.prompt}]
    elif records is None:
        records = load_prompts(settings.prompts, settings.limit)
    first = min(decoders, key=lambda d: d.decoder.context())
    lookahead = max(d.decoder.lookahead() for d in decoders)
    return [(record, first.encode(first.tokenizer(record["prompt"], add_special_tokens=False).input_ids,
                                  record["task_id"], settings.max_new_tokens, lookahead)) for record in records]


def summary_row(method: str, records: list[dict]) -> str:
    new = sum(r["new_tokens"] for r in records)
    seconds = sum(r["seconds"] for r in records)
    calls = sum(r["oracle_calls"] for r in records)
    return f"{method:<12} {len(records):>7} {new:>10} {seconds:>9.2f} {new / seconds:>9.1f} {new / calls:>16.2f}"


@exits_on_input_error
def main(argv=None) -> list[dict]:
    settings = parse(argv)
    if settings.out:
        check_output(settings.out, FILE, settings.overwrite, "--out")
    dec = SpeculativeDecoder(settings.options)
    dec.use(settings.sampling)
    if dec.decoder.policy is not None:
        print(f"plan {settings.options.plan}: {settings.options.method} with {describe(dec.decoder.policy)} (a flag you type "
              "wins; --no-plan for the flags' defaults)", file=sys.stderr)
    records = []
    for i, (record, prompt) in enumerate(encode_prompts(settings, [dec])):
        request = Request(settings.max_new_tokens, settings.sampling, settings.seed + i)
        pieces = dec.decode(prompt, request, pieces=settings.stream)
        if settings.stream:
            print(record["prompt"], end="", flush=True)
        result = drain(pieces, lambda piece: print(piece, end="", flush=True))
        if settings.stream:
            print("\n")
        records.append({
            "task_id": record["task_id"], "method": settings.options.method, "completion": result.text,
            "healed": result.healed, "token_ids": result.token_ids, "new_tokens": len(result.token_ids),
            "seconds": result.seconds, "oracle_calls": result.oracle_calls, "draft_calls": result.draft_calls,
            "tokens_per_oracle_call": result.tokens_per_oracle_call,
        })
    if settings.out:
        with atomic_output(settings.out, FILE, settings.overwrite) as tmp:
            tmp.write_text("".join(json.dumps(r) + "\n" for r in records))
    if settings.prompt is not None and not settings.stream:
        print(settings.prompt + records[0]["completion"])
        print()
    print(f"{'method':<12} {'prompts':>7} {'new tokens':>10} {'seconds':>9} {'tokens/s':>9} {'tokens/oracle call':>16}")
    print(summary_row(settings.options.method, records))
    return records


if __name__ == "__main__":
    main()
