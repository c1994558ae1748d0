"""Plan every method's tree for these models on this device, and forecast the speedup.

    python -m decode.plan --run RUN --dtype bfloat16
    python -m decode.plan --run RUN --dtype bfloat16 --project-oracle gpt2-large --overwrite

Plans for the sampling setting it is given (greedy by default; --temperature, --top-k, --top-p as in
decode.run), each setting into its own file. Calibrates on the last --calibration prompts of
--prompts (benchmarks take the first ones): the oracle's greedy outputs, how often each drafter's rank-k candidate at depth d is the oracle's token,
the oracle's forward cost per node count (the cost cache), and the time a step spends around the
forwards. Each candidate policy (chain k; Sequoia tree shapes from the rates; staged on each of those
shapes with the trigram guessing a level or two ahead of the draft, or staged widths and budget and its draft
calls a step; ngram budget; lookup length) is replayed along the oracle's outputs (every one on --screen
prompts, the best few per method on all, and a draft method's best few again with other drafts; when
sampling, each is decoded for real instead, its acceptance being random, and staged's trees are
also tried as chains of draws (--branch 1): the
draft's output layer over its most frequent tokens only, --draft-vocab, and on a CPU beside a bfloat16
oracle the draft in float32), each method's best policy also decodes a few prompts for real, after a warm-up, to
measure its own costs inside a decoding loop (a policy those costs make best is measured too), and of the
policies measured, the one with the least predicted ms per token is written to the run's plan, which
decode.run and decode.bench then use at the same setting.
--concurrency repeats the choice for several requests in flight, each one's oracle cost its share of one forward
over all their trees. --project-oracle repeats the choice with the forward costs of a larger oracle shape measured
here on random weights (at each --concurrency level too), and --project-draft with a larger draft's too (its
forwards priced at that shape's costs): a projection, not a measurement. The acceptance, the drafting's bookkeeping
and the loop's costs are the trained pair's, borrowed.
"""
import argparse
from pathlib import Path

from decode.atomic import FILE, check_output
from decode.cli.flags import check_ranges, levels
from decode.cli.help import HelpFormatter
from decode.cli.settings import encode_prompts, parse_settings
from decode.errors import exits_on_input_error
from decode.models.loading import TOKEN_COUNTS
from decode.options import MIN_DRAFT_VOCAB
from decode.plan_file import plan_name, save_plan
from decode.planning import costs
from decode.planning.planner import PlanSearch, make_plan
from decode.prompts import load_prompts
from decode.provenance import command_line


def shortlists(text: str) -> list[int]:
    try:
        sizes = [int(n) for n in text.split(",")]
    except ValueError:
        sizes = [-1]
    if any(n != 0 and n < MIN_DRAFT_VOCAB for n in sizes):
        raise argparse.ArgumentTypeError(f"{text!r}: give sizes of at least {MIN_DRAFT_VOCAB} tokens, comma-separated, or 0")
    return sizes


def parse(argv):
    p = argparse.ArgumentParser(prog="python -m decode.plan", description=__doc__.split("\n\n")[0], allow_abbrev=False, formatter_class=HelpFormatter,
                                epilog="Every other flag is decode.run's (--run, --oracle, --draft, --ngram, --prompts, "
                                       "--max-new-tokens, --dtype, --device, --backend, --lookup-ngram, ...).")
    p.add_argument("--calibration", type=int, default=100,
                   help="calibrate on the last N prompts of --prompts (decode.bench --limit 50 takes the first 50 of 164)")
    p.add_argument("--screen", type=int, default=16,
                   help="replay every candidate policy on the first N calibration prompts, the best few on all of them")
    p.add_argument("--max-budget", type=int, default=64, help="the largest oracle tree considered (nodes)")
    p.add_argument("--max-depth", type=int, default=8, help="the deepest tree level considered")
    p.add_argument("--project-oracle", help="also forecast for an oracle of this shape: gpt2, gpt2-medium, gpt2-large, "
                                            "gpt2-xl or n_layer,n_embd,vocab (costs measured here on random weights)")
    p.add_argument("--project-draft", help="with --project-oracle, price the draft's forwards at this shape's costs: "
                                           "draft-40m (the paper preset's draft, 4 x 512) or n_layer,n_embd,vocab")
    p.add_argument("--draft-vocab", type=shortlists, metavar="N[,N...]",
                   help="the draft shortlists (decode.run --draft-vocab) each method's best policy is replayed with, "
                        "besides the whole vocabulary; the plan keeps the fastest (default: the largest power of two up to "
                        f"half the vocabulary, when the draft has {TOKEN_COUNTS}; 0: none)")
    p.add_argument("--concurrency", type=levels, default=(1,), metavar="N[,N...]",
                   help="greedy: also choose each method's policy for N requests in flight, their trees scored in one "
                        "oracle forward (decode.serve, generate_batch); a request takes the policy of the largest N "
                        "up to the requests in flight as it joins (default: 1, decoding alone)")
    p.add_argument("--out", type=Path, help="where the plan goes (default: RUN/plan.json when greedy, else the "
                                            "setting's own, e.g. RUN/plan-t1-k50-p1.json, which decode.run and "
                                            "decode.bench read at that setting)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing plan")
    known, rest = p.parse_known_args(argv)
    settings = parse_settings(rest + ["--method", "staged", "--no-plan"], "python -m decode.plan",
                              __doc__.split("\n\n")[0], dtype_from_plan=False)
    check_ranges(p, [("--calibration", known.calibration, 1, None), ("--screen", known.screen, 2, None),
                     ("--max-budget", known.max_budget, 2, 512), ("--max-depth", known.max_depth, 1, 16)])
    if known.out is None and settings.run is None:
        p.error("pass --out PATH (or --run RUN for the run's plan)")
    known.out = known.out or settings.run / plan_name(settings.sampling)
    if known.concurrency != (1,) and not settings.sampling.greedy:
        p.error("--concurrency plans greedy decoding only: a sampled request keeps its setting's policy at any load, "
                "so that its seed gives the same output alone or beside others")
    if known.project_draft and not known.project_oracle:
        p.error("--project-draft prices a projected oracle's drafter: give --project-oracle too")
    if known.project_oracle:  # a bad shape fails now, not after the calibration
        costs.projection_shape(known.project_oracle)
    if known.project_draft:
        costs.projection_shape(known.project_draft, "--project-draft")
    return known, settings


def calibration_prompts(settings, known, dec):
    """The last --calibration prompts, `spread` so that the first --screen of them (screened on, and decoded for real
    to measure the in-loop costs) come from across them."""
    given = [{"task_id": "prompt", "prompt": settings.prompt}] if settings.prompt is not None else None
    records = spread((given or load_prompts(settings.prompts))[-known.calibration :], known.screen)
    return [prompt for _, prompt in encode_prompts(settings, [dec], records)]


def spread(items: list, first: int) -> list:
    """`items` reordered so that the first `first` are evenly spaced over the list, in order, the rest after them:
    prompts harvested from one file come together and are alike, so a block of neighbours is a biased sample."""
    picked = range(0, len(items), max(1, len(items) // first))[:first]
    return [items[i] for i in picked] + [item for i, item in enumerate(items) if i not in picked]


@exits_on_input_error
def main(argv=None) -> dict:
    known, settings = parse(argv)
    check_output(known.out, FILE, known.overwrite, "--out", settings.reads(), run_file=True)
    search = PlanSearch(settings.sampling, settings.max_new_tokens, settings.seed, known.screen, known.max_budget,
                        known.max_depth, known.draft_vocab, known.project_oracle, known.project_draft,
                        known.concurrency)
    command = command_line("python -m decode.plan", argv)
    plan = make_plan(settings.flags.base, lambda dec: calibration_prompts(settings, known, dec), search,
                     str(settings.prompts or "--prompt"), command)
    save_plan(plan, known.out, known.overwrite)
    print(f"plan: {known.out} (decode.run and decode.bench use it; --no-plan turns it off)")
    return plan


if __name__ == "__main__":
    main()
