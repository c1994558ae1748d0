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
--project-oracle repeats the choice with the forward costs of a larger oracle shape measured
here on random weights, and --project-draft with a larger draft's too (its forwards priced at that shape's costs):
a projection, not a measurement. The acceptance, the drafting's bookkeeping and the loop's costs are the trained
pair's, borrowed.
"""
import argparse
import datetime
import math
import shlex
import sys
from typing import Callable
from dataclasses import replace
from pathlib import Path

import torch

from decode.cli.help import HelpFormatter
from decode.atomic import FILE, check_output
from decode.errors import exits_on_input_error
from decode.prompts import load_prompts
from decode.models.loading import TOKEN_COUNTS
from decode import loop, timing
from decode.api import SpeculativeDecoder
from decode.cli.explain import interval_text
from decode.cli.in_loop import FreshProcess, calibrate_in_loop
from decode.cli.settings import encode_prompts, parse_settings
from decode.models.cached_lm import CachedLM
from decode.models.calibration import calibrate
from decode.models.loading import load_draft, load_trigram
from decode.options import MIN_DRAFT_VOCAB
from decode.planning import costs, kinds, replay, shapes
from decode.planning.search import (RANKS, base_dtype, best, forecast, measured_forecast, replay_policies,
                                    variant_name)
from decode.planning.plan_file import PLAN_VERSION, describe, identity, plan_name, save_plan
from decode.sampling import Sampling

GREEDY = Sampling()


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
    p.add_argument("--out", type=Path, help="where the plan goes (default: RUN/plan.json when greedy, else the "
                                            "setting's own, e.g. RUN/plan-t1-k50-p1.json, which decode.run and "
                                            "decode.bench read at that setting)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing plan")
    known, rest = p.parse_known_args(argv)
    settings = parse_settings(rest + ["--method", "staged", "--no-plan"], "python -m decode.plan",
                              __doc__.split("\n\n")[0], dtype_from_plan=False)
    if known.calibration < 1 or known.screen < 2 or not 2 <= known.max_budget <= 512 or not 1 <= known.max_depth <= 16:
        p.error("need --calibration >= 1, --screen >= 2, --max-budget 2..512 and --max-depth 1..16")
    if known.out is None and settings.run is None:
        p.error("pass --out PATH (or --run RUN for the run's plan)")
    known.out = known.out or settings.run / plan_name(settings.sampling)
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
    records = spread(load_prompts(settings.prompts)[-known.calibration :], known.screen)
    return [prompt for _, prompt in encode_prompts(settings, [dec], records)]


def spread(items: list, first: int) -> list:
    """`items` reordered so that the first `first` are evenly spaced over the list, in order, the rest after them:
    prompts harvested from one file come together and are alike, so a block of neighbours is a biased sample."""
    picked = range(0, len(items), max(1, len(items) // first))[:first]
    return [items[i] for i in picked] + [item for i, item in enumerate(items) if i not in picked]


def oracle_outputs(decoder, prompts, max_new_tokens: int) -> list[tuple[list[int], list[int]]]:
    """The oracle's greedy continuation of each prompt."""
    return [(p.ids.tolist(), loop.baseline(decoder.oracle, p.ids, max_new_tokens, GREEDY, decoder.eos_id,
                                           allowed=p.allowed).tokens) for p in prompts]


def sampled_acceptance(decoder, prompts, settings, depth: int) -> dict:
    """Under the sampling setting, along the oracle's sampled outputs: how often a chain of draft
    samples is accepted to each depth (teacher forced, Chen et al.'s acceptance rule)."""
    overlap_lists = []
    for i, prompt in enumerate(prompts):
        generator = torch.Generator(decoder.oracle.device).manual_seed(settings.seed + i)
        out = loop.baseline(decoder.oracle, prompt.ids, settings.max_new_tokens, settings.sampling, decoder.eos_id,
                            generator=generator, allowed=prompt.allowed)
        overlap_lists.append(shapes.overlaps(decoder.oracle, decoder.draft, settings.sampling, prompt.ids.tolist(),
                                               out.tokens))
    s = settings.sampling
    return {"setting": f"T={s.temperature} top-k {s.top_k} top-p {s.top_p}",
            "draft_chain": shapes.chain_acceptance(overlap_lists, depth)}


def shortlist_sizes(requested: list[int] | None, options, vocab_size: int) -> list[int]:
    """The draft shortlists to weigh against the whole vocabulary: those requested, or by default the
    largest power of two up to half of the vocabulary when the draft has its token counts (smaller
    ones lost acceptance on other prompts than the calibration's: docs/planning.md)."""
    if requested is None:
        if not (Path(options.draft) / TOKEN_COUNTS).is_file():
            print(f"note: {options.draft} has no {TOKEN_COUNTS} (training writes it), so the plan keeps the draft's "
                  f"whole vocabulary", file=sys.stderr)
            return []
        requested = [2 ** int(math.log2(vocab_size / 2))]
    return [n for n in requested if MIN_DRAFT_VOCAB <= n < vocab_size]


def draft_variants(sizes: list[int], options, vocab_size: int) -> dict[tuple[int, str], CachedLM]:
    """The drafts besides the plan's own (whole vocabulary, `base_dtype`) that each draft method's finalists are
    replayed with, by (shortlist size or 0, dtype): each of `sizes` and the whole vocabulary, in the base dtype and,
    when that is bfloat16 on a CPU, in float32. A draft's forwards of a few rows are mostly per-call overhead, which
    on a CPU differs by dtype (on an AMX CPU, MKL's float32 products of one row took 4-12 us against oneDNN's
    bfloat16 19-25): measured. A GPU launches the same kernels either way (not weighed there)."""
    on_cpu = torch.device(options.device).type == "cpu"
    dtypes = [base_dtype(options)] + ["float32"] * (base_dtype(options) != "float32" and on_cpu)
    return {(n, dtype): load_draft(replace(options, draft_vocab=n, draft_dtype=dtype), vocab_size)
            for n in [0, *sizes] for dtype in dtypes if (n, dtype) != (0, base_dtype(options))}


def replayer(decoder, prompts: list, sequences: list, settings) -> Callable:
    """How a policy is replayed on the first n calibration prompts: greedy, along the oracle's outputs
    (`sequences`); sampling, by decoding them for real under the settings' sampling."""
    if settings.sampling.greedy:
        return lambda drafter, n: replay.replay(drafter, sequences[:n])
    return lambda drafter, n: replay.sampled(drafter, decoder.oracle, prompts[:n], settings.max_new_tokens,
                                             settings.sampling, decoder.eos_id, settings.seed)


def print_kinds(rows: list[dict], one_row_ms: float) -> None:
    """Each kind of tree at its best (planning.kinds.kinds_table), in a table: why the plan drafts the kind it does."""
    print(f"each kind of tree at its best, priced as above (the oracle's cost of a call in one-row forwards of "
          f"{one_row_ms:.2f} ms):")
    print(f"  {'kind':<15} {'method':<12} {'nodes':>6} {'tokens/call':>11} {'oracle cost/call':>16} "
          f"{'drafting ms/call':>16} {'speedup':>8}  policy")
    for r in rows:
        print(f"  {r['kind']:<15} {r['method']:<12} {r['nodes']:6.1f} {r['tokens_per_call']:11.2f} "
              f"{r['oracle_forwards_per_call']:15.2f}x {r['drafting_ms_per_call']:16.3f} {r['speedup']:7.2f}x  "
              + describe(r["policy"]))


def print_forecast(title: str, predicted: dict) -> None:
    print(title)
    print(f"  {'method':<12} {'tokens/call':>11} {'ms/token':>9} {'speedup':>8} {'90% interval':>13}  policy")
    for method, p in predicted.items():
        spread = interval_text(p.get("speedup_interval"), bracketed=False)
        print(f"  {method:<12} {p['tokens_per_call']:11.2f} {p['ms_per_token']:9.3f} {p['speedup']:7.2f}x {spread:>13}  "
              + describe(p.get("policy", {})))


def context_curves(model: CachedLM, largest: int) -> tuple[costs.ContextCosts, dict[int, float]]:
    """A model's ms per forward of q = 0 .. largest nodes after each of the planning's cached lengths
    (costs.context_lengths), measured now; and its table after the first of them."""
    tables = {cached: timing.forward_costs(model, prefix=cached, repeats=5)
              for cached in costs.context_lengths(model.max_length)}
    return costs.ContextCosts.of_tables(tables, largest), next(iter(tables.values()))


def projected_costs(oracle_spec: str, draft_spec: str | None, draft_keys: list[tuple[int, str]], options, sequences,
                    max_budget: int) -> dict:
    """The forward costs of an oracle of shape `oracle_spec` measured here on random weights: its ms per node count,
    the baseline's costs under them, and the shape; with `draft_spec`, a draft of that shape's ms per forward for
    each of the plan's drafts (`draft_keys`: shortlist size, dtype)."""
    n_layer, n_embd, vocab = costs.projection_shape(oracle_spec)
    prompt_length = round(sum(len(p) for p, _ in sequences) / len(sequences))
    big_ms, big_costs = context_curves(costs.random_gpt2(n_layer, n_embd, vocab, options.dtype, options.device),
                                       max(2 * max_budget, prompt_length))
    projected = {"ms": big_ms, "baseline": {"prefill": float(big_ms.at([prompt_length], [0])[0]),
                                            "one_token": big_costs[1], "loop": 0.0},
                 "oracle": oracle_spec, "shape": [n_layer, n_embd, vocab], "oracle_ms": big_costs, "draft_ms": None,
                 "machine": timing.machine_name(torch.device(options.device)), "date": datetime.date.today().isoformat()}
    if draft_spec:
        shape = costs.projection_shape(draft_spec, "--project-draft")
        models = {(n, dtype): costs.random_gpt2(*shape, dtype, options.device, shortlist=n) for n, dtype in draft_keys}
        # a prompt's first draft call reads all of it
        curves = {key: context_curves(model, model.max_length + 2 * max_budget) for key, model in models.items()}
        projected |= {"draft": draft_spec, "draft_shape": list(shape),
                      "draft_ms": {key: ms for key, (ms, _) in curves.items()},
                      "draft_one_row_ms": {f"{variant_name(*key)}": table[1] for key, (_, table) in curves.items()}}
    return projected


@exits_on_input_error
def main(argv=None) -> dict:
    known, settings = parse(argv)
    check_output(known.out, FILE, known.overwrite, "--out", settings.reads())
    options = settings.flags.base  # the flags as typed: the candidates start from them, not from a default policy
    for role, what in calibrate(options).items():  # what the plan's measurements, and later decoding, run with
        print(f"calibrated the {role}: {what}")
    dec = SpeculativeDecoder(options)
    decoder, oracle, draft = dec.decoder, dec.decoder.oracle, dec.decoder.draft
    table = load_trigram(options, oracle.vocab_size, decoder.eos_id)
    drafts = draft_variants(shortlist_sizes(known.draft_vocab, options, oracle.vocab_size), options, oracle.vocab_size)
    prompts = calibration_prompts(settings, known, dec)
    print(f"calibrating on {len(prompts)} prompts x {settings.max_new_tokens} tokens, {options.dtype} on "
          f"{timing.device_name(oracle.device)}")
    tables = {cached: costs.measured_costs(options.oracle, oracle, options.dtype, prefix=cached)[0]
              for cached in costs.context_lengths(oracle.max_length)}
    oracle_costs = next(iter(tables.values()))  # after 128 cached positions
    isolated_ms = costs.ContextCosts.of_tables(tables, 2 * known.max_budget)
    sequences = oracle_outputs(decoder, prompts, settings.max_new_tokens)
    p_draft = shapes.acceptance([shapes.ranks(draft, p, c) for p, c in sequences], RANKS, known.max_depth)
    p_trigram = shapes.acceptance([shapes.trigram_ranks(table, p, c) for p, c in sequences], min(RANKS, table.k),
                                  known.max_depth)
    sampled = None if settings.sampling.greedy else sampled_acceptance(decoder, prompts, settings, known.max_depth)
    # the projection is measured first: the finalists include the best policies for it
    projection = known.project_oracle and projected_costs(known.project_oracle, known.project_draft,
                                                          [(0, base_dtype(options)), *drafts], options, sequences,
                                                          known.max_budget)
    oracle_curves = [(isolated_ms, {"prefill": 0.0, "one_token": oracle_costs[1], "loop": 0.0}, None)]
    oracle_curves += [(projection["ms"], projection["baseline"], projection["draft_ms"])] if projection else []
    replays = replay_policies(options, draft, table, p_draft, replayer(decoder, prompts, sequences, settings),
                              len(prompts), oracle_curves, drafts, settings.sampling, known.screen, known.max_budget,
                              known.max_depth)
    with (FreshProcess(options, prompts[: known.screen], settings, isolated_ms) as fresh,
          FreshProcess(options, prompts[: known.screen], settings, isolated_ms) as another):
        measured, baseline = calibrate_in_loop(fresh.measure, another.measure, replays, isolated_ms)
    predicted, in_loop = measured_forecast(measured, isolated_ms, baseline)
    print_forecast(f"predicted for {settings.sampling.describe()} on this device (oracle q=1 forward {oracle_costs[1]:.2f} ms in isolation, "
                   f"{baseline['one_token']:.2f} ms in the baseline's loop; tokens per call count each prompt's "
                   f"prefill, as decode.bench does):", predicted)
    every_policy = forecast(replays, isolated_ms, baseline, in_loop, keep=None)
    kinds_shown = kinds.kinds_table(kinds.with_choices(every_policy, predicted), oracle_costs[1])
    print_kinds(kinds_shown, oracle_costs[1])
    plan = {"version": PLAN_VERSION, "identity": identity(options),
            "sampling": settings.sampling.describe(),
            "calibration": {"prompts": str(settings.prompts), "count": len(prompts), "tokens": sum(len(c) for _, c in sequences),
                            "prompt_tokens": sum(len(p) for p, _ in sequences) / len(sequences),
                            "max_new_tokens": settings.max_new_tokens, "token_healing": options.token_healing},
            "policies": {m: p["policy"] for m, p in predicted.items() if m != "baseline"}, "predicted": predicted,
            "kinds": kinds_shown,
            "acceptance": {"draft": p_draft, "trigram": p_trigram, "sampled": sampled},
            "costs": {"oracle_ms": oracle_costs, "oracle_ms_after": tables, "baseline_in_loop_ms": baseline,
                      "in_loop": in_loop}}
    if sampled is not None:
        print(f"sampling ({sampled['setting']}): a sampled draft chain's first d tokens are accepted with probability "
              + ", ".join(f"{a:.2f}" for a in sampled["draft_chain"]) + " (d = 1, 2, ...)")
    if projection:
        command = "python -m decode.plan " + shlex.join(sys.argv[1:] if argv is None else list(argv))
        plan["projection"] = project(projection, replays, in_loop, baseline) | {"command": command}
    save_plan(plan, known.out, known.overwrite)
    print(f"plan: {known.out} (decode.run and decode.bench use it; --no-plan turns it off)")
    return plan


def project(projection: dict, replays: dict, in_loop: dict, baseline: dict) -> dict:
    """The best policies under a projected oracle's (and draft's) costs, printed with what was measured and what
    borrowed; the plan's record of them."""
    own_costs = {method: {**f, "oracle": 1.0} for method, f in in_loop.items()}  # measured on this oracle only
    projected = best(forecast(replays, projection["ms"], {**projection["baseline"], "loop": baseline["loop"]}, own_costs,
                              draft_ms=projection["draft_ms"]))
    n_layer, n_embd, vocab = projection["shape"]
    draft = "these drafters"
    sources = {"measured here, on random weights": [f"the {projection['oracle']} oracle's forward costs"],
               "borrowed from the trained pair": ["the acceptance (tokens per call)", "the drafting's bookkeeping",
                                                  "the decoding loop's costs"]}
    if "draft" in projection:
        d_layer, d_embd, d_vocab = projection["draft_shape"]
        draft = f"a {projection['draft']} draft ({d_layer} x {d_embd}, vocabulary {d_vocab})"
        sources["measured here, on random weights"].append(f"the {projection['draft']} draft's forward costs")
    else:
        sources["borrowed from the trained pair"].append("the draft's forward costs")
    print_forecast(f"PROJECTION (not a measurement) for a {projection['oracle']} oracle ({n_layer} layers x {n_embd}, "
                   f"vocabulary {vocab}; q=1 forward {projection['oracle_ms'][1]:.1f} ms here) with {draft} and these "
                   f"drafters' acceptance:", projected)
    for source, parts in sources.items():
        print(f"  {source}: {', '.join(parts)}")
    kept = ("oracle", "shape", "oracle_ms", "draft", "draft_shape", "draft_one_row_ms", "machine", "date")
    return {key: projection[key] for key in kept if key in projection} | {"sources": sources, "predicted": projected}


if __name__ == "__main__":
    main()
