"""The planner: every method's tree for a decoder's models on this device, and the forecast of its speedup
(decode.plan is its command).

`make_plan` calibrates on encoded prompts: the oracle's outputs along which each candidate policy is replayed, how
often each drafter's rank-k candidate at depth d is the oracle's token, the oracle's forward costs, and each method's
best policies decoded for real in a fresh process (decode.planning.in_loop); it returns the plan's record
(decode.plan_file saves and reads it)."""
import datetime
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from decode import loop
from decode.api import SpeculativeDecoder
from decode.benchmarking.explain import interval_text
from decode.devices import device_name, kind, machine_name
from decode.errors import InputError
from decode.healing import Prompt
from decode.models.cached_lm import CachedLM
from decode.models.calibration import calibrate
from decode.models.loading import TOKEN_COUNTS, load_draft, load_trigram
from decode.models.quantized import Format, dtype_and_format, format_name
from decode.options import MIN_DRAFT_VOCAB
from decode.plan_file import PLAN_VERSION, describe, identity
from decode.planning import costs, kinds, replay, shapes
from decode.planning.concurrency import shared_baseline, shared_costs
from decode.planning.costs import cost_curve
from decode.planning.in_loop import FreshProcess, calibrate_in_loop
from decode.planning.search import RANKS, base_dtype, best, forecast, measured_forecast, replay_policies, variant_name
from decode.provenance import provenance
from decode.sampling import GREEDY, Sampling
from decode.timing.forwards import forward_costs


@dataclass(frozen=True)
class PlanSearch:
    """What a plan calibrates under and how far it searches: the sampling setting, tokens and seed its decodings
    use; the calibration prompts replayed on with every candidate (`screen`, which the in-loop measurement decodes
    too); the largest tree; the draft shortlists weighed (None: the default, `shortlist_sizes`); and the larger
    oracle (and draft) shape to project the choice for."""

    sampling: Sampling
    max_new_tokens: int
    seed: int
    screen: int
    max_budget: int
    max_depth: int
    draft_vocab: list[int] | None = None
    project_oracle: str | None = None
    project_draft: str | None = None
    concurrency: tuple[int, ...] = (1,)  # the numbers of requests in flight to choose a policy for


def make_plan(options, calibration_prompts: Callable[[object], list[Prompt]], search: PlanSearch, source: str,
              command: str) -> dict:
    """The plan of a decoder built from `options` (the flags as typed: the candidates start from them, not from a
    default policy), calibrated on the prompts `calibration_prompts(decoder)` encodes for that SpeculativeDecoder
    (read from `source`); `command` is what a projection records as its origin. Each model is calibrated first
    (decode.models.calibration): the plan's measurements, and later decoding, run with what it chose."""
    for role, what in calibrate(options).items():
        print(f"calibrated the {role}: {what}")
    dec = SpeculativeDecoder(options)
    decoder = dec.decoder
    oracle, draft = decoder.oracle, decoder.draft
    table = load_trigram(options, oracle.vocab_size, decoder.eos_id)
    drafts = draft_variants(shortlist_sizes(search.draft_vocab, options, oracle.vocab_size), options, oracle.vocab_size)
    prompts = calibration_prompts(dec)
    print(f"calibrating on {len(prompts)} prompts x {search.max_new_tokens} tokens, {options.dtype} on "
          f"{device_name(oracle.device)}")
    tables = {cached: costs.measured_costs(options.oracle, oracle, options.dtype, prefix=cached)[0]
              for cached in costs.context_lengths(oracle.max_length)}
    oracle_costs = next(iter(tables.values()))  # after 128 cached positions
    isolated_ms = costs.ContextCosts.of_tables(tables, 2 * search.max_budget)
    sequences = oracle_outputs(decoder, prompts, search.max_new_tokens)
    assert draft is not None, "the planner plans staged, which needs a draft (the options were checked)"
    p_draft = shapes.acceptance([shapes.ranks(draft, p, c) for p, c in sequences], RANKS, search.max_depth)
    p_trigram = shapes.acceptance([shapes.trigram_ranks(table, p, c) for p, c in sequences], min(RANKS, table.k),
                                  search.max_depth)
    sampled = None if search.sampling.greedy else sampled_acceptance(decoder, prompts, search)
    # the projection is measured first: the finalists include the best policies for it
    projection = projected_costs(search.project_oracle, search.project_draft, [(0, base_dtype(options)), *drafts],
                                 options, sequences, search.max_budget, search.concurrency,
                                 (oracle.runtime.quantization, draft.runtime.quantization)
                                 ) if search.project_oracle else None
    # each load's costs too: the finalists include the best policies for it
    loads = at_loads(tables, 2 * search.max_budget, search.concurrency)
    oracle_curves = [(ms, {"prefill": 0.0, "one_token": one_row, "loop": 0.0}, None)
                     for ms, one_row in [(isolated_ms, oracle_costs[1]), *loads.values()]]
    if projection:
        oracle_curves += [(ms, {"prefill": 0.0, "one_token": one_row, "loop": 0.0}, projection["draft_ms"])
                          for ms, one_row in [(projection["ms"], projection["oracle_ms"][1]),
                                              *projection["loads"].values()]]
    replays = replay_policies(options, draft, table, p_draft, replayer(decoder, prompts, sequences, search),
                              len(prompts), oracle_curves, drafts, search.sampling, search.screen, search.max_budget,
                              search.max_depth)
    with (FreshProcess(options, prompts[: search.screen], search, isolated_ms) as fresh,
          FreshProcess(options, prompts[: search.screen], search, isolated_ms) as another):
        measured, baseline = calibrate_in_loop(fresh.measure, another.measure, replays, isolated_ms)
    predicted, in_loop = measured_forecast(measured, isolated_ms, baseline)
    print_forecast(f"predicted for {search.sampling.describe()} on this device (oracle q=1 forward {oracle_costs[1]:.2f} "
                   f"ms in isolation, {baseline['one_token']:.2f} ms in the baseline's loop; tokens per call count each "
                   f"prompt's prefill, as decode.bench does):", predicted)
    every_policy = forecast(replays, isolated_ms, baseline, in_loop, keep=None)
    kinds_shown = kinds.kinds_table(kinds.with_choices(every_policy, predicted), oracle_costs[1])
    print_kinds(kinds_shown, oracle_costs[1])
    plan = {"version": PLAN_VERSION, "identity": identity(options), "measured_with": provenance(),
            "sampling": search.sampling.describe(),
            "calibration": {"prompts": source, "count": len(prompts), "tokens": sum(len(c) for _, c in sequences),
                            "prompt_tokens": sum(len(p) for p, _ in sequences) / len(sequences),
                            "max_new_tokens": search.max_new_tokens, "token_healing": options.token_healing},
            "policies": {m: p["policy"] for m, p in predicted.items() if m != "baseline"}, "predicted": predicted,
            "kinds": kinds_shown,
            "acceptance": {"draft": p_draft, "trigram": p_trigram, "sampled": sampled},
            "costs": {"oracle_ms": oracle_costs, "oracle_ms_after": tables, "baseline_in_loop_ms": baseline,
                      "in_loop": in_loop}}
    if sampled is not None:
        print(f"sampling ({sampled['setting']}): a sampled draft chain's first d tokens are accepted with probability "
              + ", ".join(f"{a:.2f}" for a in sampled["draft_chain"]) + " (d = 1, 2, ...)")
    if projection:
        plan["projection"] = project(projection, replays, in_loop, baseline) | {"command": command}
    if loads:
        plan["concurrency"] = {str(n): at_load(n, ms, shared_baseline(baseline, oracle_costs[1], one_row), replays,
                                               in_loop) for n, (ms, one_row) in loads.items()}
    return plan


def at_load(requests: int, oracle_ms, baseline: dict, replays: dict, in_loop: dict, draft_ms: dict | None = None,
            what: str = "predicted") -> dict:
    """Each method's best policy when `requests` requests are in flight, their trees scored in one oracle forward
    (`oracle_ms`, `baseline`: each one's share of its costs; drafting and the loop as measured alone, or the draft's
    forwards priced by `draft_ms` as forecast's), printed under `what`; the plan's record of them. Speedups are over
    plain decoding at the same load."""
    predicted = best(forecast(replays, oracle_ms, baseline, in_loop, draft_ms=draft_ms))
    print_forecast(f"{what} at {requests} requests in flight (each step's oracle forward shared among them; "
                   f"speedups over plain decoding at {requests}):", predicted)
    return {"policies": {m: p["policy"] for m, p in predicted.items() if m != "baseline"}, "predicted": predicted}


def oracle_outputs(decoder, prompts, max_new_tokens: int) -> list[tuple[list[int], list[int]]]:
    """The oracle's greedy continuation of each prompt."""
    return [(p.ids.tolist(), loop.baseline(decoder.oracle, p.ids, max_new_tokens, GREEDY, decoder.stop_ids,
                                           allowed=p.allowed).tokens) for p in prompts]


def sampled_acceptance(decoder, prompts, search: PlanSearch) -> dict:
    """Under the search's sampling setting, along the oracle's sampled outputs: how often a chain of draft
    samples is accepted to each depth (teacher forced, Chen et al.'s acceptance rule)."""
    overlap_lists = []
    for i, prompt in enumerate(prompts):
        generator = torch.Generator(decoder.oracle.device).manual_seed(search.seed + i)
        out = loop.baseline(decoder.oracle, prompt.ids, search.max_new_tokens, search.sampling, decoder.stop_ids,
                            generator=generator, allowed=prompt.allowed)
        overlap_lists.append(shapes.overlaps(decoder.oracle, decoder.draft, search.sampling, prompt.ids.tolist(),
                                             out.tokens))
    s = search.sampling
    return {"setting": f"T={s.temperature} top-k {s.top_k} top-p {s.top_p}",
            "draft_chain": shapes.chain_acceptance(overlap_lists, search.max_depth)}


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
    replayed with, by (shortlist size or 0, dtype or block format): each of `sizes` and the whole vocabulary, in the
    base dtype and in each of the device's other draft precisions (DeviceKind.draft_precisions: on a CPU float32 and
    the draft quantized as it loads to Q8_0 and Q4_0). A draft's forwards of a few rows are mostly per-call overhead,
    which on a CPU differs by dtype and format, so it is measured. A precision the draft cannot load in (a draft
    quantized already, or one the block formats do not fit) is left out, with a note."""
    base = base_dtype(options)
    drafts: dict[tuple[int, str], CachedLM] = {}
    for precision in [base, *(p for p in kind(options.device).draft_precisions if p != base)]:
        try:
            drafts |= {(n, precision): load_draft(replace(options, draft_vocab=n, draft_dtype=precision), vocab_size)
                       for n in [0, *sizes] if (n, precision) != (0, base)}
        except InputError as err:
            print(f"note: not weighing the draft in {precision}: {err}", file=sys.stderr)
    return drafts


def replayer(decoder, prompts: list, sequences: list, search: PlanSearch) -> Callable:
    """How a policy is replayed on the first n calibration prompts: greedy, along the oracle's outputs
    (`sequences`); sampling, by decoding them for real under the search's sampling."""
    if search.sampling.greedy:
        return lambda drafter, n: replay.replay(drafter, sequences[:n])
    return lambda drafter, n: replay.sampled(drafter, decoder, prompts[:n], search.max_new_tokens, search.sampling,
                                             search.seed)


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


def at_loads(tables: dict[int, dict[int, float]], largest: int, concurrency: tuple[int, ...]
             ) -> dict[int, tuple[costs.ContextCosts, float]]:
    """For each number of requests in flight past one: what a tree of q nodes costs each of them (shared_costs,
    from a model's cost `tables` after each cached length) and each one's share of a forward of one row each."""
    one_row = next(iter(tables.values()))
    return {n: (shared_costs(tables, largest, n), float(cost_curve(one_row, n)[n]) / n) for n in concurrency if n > 1}


def context_tables(model: CachedLM) -> dict[int, dict[int, float]]:
    """A model's ms per forward of each measured node count after each of the planning's cached lengths
    (costs.context_lengths), measured now."""
    return {cached: forward_costs(model, prefix=cached, repeats=5, counts=costs.PLANNED_COUNTS)
            for cached in costs.context_lengths(model.max_length)}


def projected_costs(oracle_spec: str, draft_spec: str | None, draft_keys: list[tuple[int, str]], options, sequences,
                    max_budget: int, concurrency: tuple[int, ...] = (1,),
                    formats: tuple[Format | None, Format | None] = (None, None)) -> dict:
    """The forward costs of an oracle of shape `oracle_spec` measured here on random weights: its ms per node count,
    the baseline's costs under them, each load's (`concurrency`: at_loads), and the shape; with `draft_spec`, a draft
    of that shape's ms per forward for each of the plan's drafts (`draft_keys`: shortlist size, dtype). The projected
    models' matrices are in the block formats of the oracle and the draft planned (`formats`; None: unquantized)."""
    n_layer, n_embd, vocab = costs.projection_shape(oracle_spec)
    prompt_length = round(sum(len(p) for p, _ in sequences) / len(sequences))
    oracle_format, draft_format = formats
    big_tables = context_tables(costs.random_gpt2(n_layer, n_embd, vocab, options.dtype, options.device,
                                                  quantization=oracle_format))
    big_ms = costs.ContextCosts.of_tables(big_tables, max(2 * max_budget, prompt_length))
    big_costs = next(iter(big_tables.values()))
    projected: dict = {"ms": big_ms, "baseline": {"prefill": float(big_ms.at([prompt_length], [0])[0]),
                                                    "one_token": big_costs[1], "loop": 0.0},
                         "loads": at_loads(big_tables, 2 * max_budget, concurrency),
                         "oracle": oracle_spec, "shape": [n_layer, n_embd, vocab], "oracle_ms": big_costs, "draft_ms": None,
                         "formats": [format_name(f) for f in formats],
                         "machine": machine_name(torch.device(options.device)), "date": datetime.date.today().isoformat(),
                         **provenance()}
    if draft_spec:
        shape = costs.projection_shape(draft_spec, "--project-draft")
        models = {(n, precision): costs.random_gpt2(*shape, dtype, options.device, shortlist=n, quantization=fmt or draft_format)
                  for n, precision in draft_keys for dtype, fmt in [dtype_and_format(precision, options.dtype)]}
        # a prompt's first draft call reads all of it
        measured = {key: context_tables(model) for key, model in models.items()}
        projected |= {"draft": draft_spec, "draft_shape": list(shape),
                      "draft_ms": {key: costs.ContextCosts.of_tables(tables, models[key].max_length + 2 * max_budget)
                                   for key, tables in measured.items()},
                      "draft_one_row_ms": {f"{variant_name(*key)}": next(iter(tables.values()))[1]
                                           for key, tables in measured.items()}}
    return projected


def project(projection: dict, replays: dict, in_loop: dict, baseline: dict) -> dict:
    """The best policies under a projected oracle's (and draft's) costs, printed with what was measured and what
    borrowed; the plan's record of them."""
    own_costs = {method: {**f, "oracle": 1.0} for method, f in in_loop.items()}  # measured on this oracle only
    big_baseline = {**projection["baseline"], "loop": baseline["loop"]}
    projected = best(forecast(replays, projection["ms"], big_baseline, own_costs, draft_ms=projection["draft_ms"]))
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
    loads = {str(n): at_load(n, ms, shared_baseline(big_baseline, projection["oracle_ms"][1], one_row), replays,
                             own_costs, projection["draft_ms"], f"PROJECTION for the {projection['oracle']} oracle")
             for n, (ms, one_row) in projection["loads"].items()}
    kept = ("oracle", "shape", "oracle_ms", "draft", "draft_shape", "draft_one_row_ms", "machine", "date",
            *provenance())  # what it was measured with, as projected_costs recorded it
    return ({key: projection[key] for key in kept if key in projection} | {"sources": sources, "predicted": projected}
            | ({"concurrency": loads} if loads else {}))
