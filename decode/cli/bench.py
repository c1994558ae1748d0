"""How much faster than plain decoding, with the same output? Every method in one process, same prompts.

    python -m decode.bench --run RUN --limit 50 --max-new-tokens 128 --out results.json --plot speedup.png
    python -m decode.bench --run RUN --temperature 1 --top-k 50 --methods baseline,speculative,staged

Methods run interleaved per prompt (the order rotates), so machine noise hits all alike, after a
warm-up on the first prompt. Per method: tokens/s, per-prompt speedup over the baseline (time per
token), tokens per oracle call, oracle calls per token (the paper's memory-traffic ratio) and mean
oracle batch. Greedy outputs must equal the baseline's: a method that differs beyond numerical
near-ties gets no speedup, and the prompts are named. The peers: `hf-generate` (transformers
generate on the oracle), `hf-assisted` (generate with the draft as assistant model), `hf-lookup`
(generate with prompt lookup, `--lookup-tokens` per draft), and llama.cpp on the oracle exported to
GGUF in the run's dtype, on as many threads as ours: `llamacpp` (plain) and `llamacpp-lookup` (its
prompt-lookup draft), skipped with a note without llama-cpp-python (pip install -e ".[llamacpp]"); and
llama.cpp through its llama-server binary (on PATH, or LLAMA_SERVER): `llamacpp-server` (its plain decoding),
`llamacpp-draft` (its draft-model speculation with our draft, at the --spec-draft-n-max that ran fastest on the first
prompts) and `llamacpp-ngram` (the fastest of its n-gram drafters), skipped with a note without the binary. The
peak resident memory of this process and of each llama-server is printed and kept in the JSON.
`lookup` is ours: the same idea as a drafter.
With the run's plan for the sampling setting (python -m decode.plan, with the same --temperature,
--top-k and --top-p) every method of ours runs its planned policy and the table puts the plan's
predicted tokens per call and speedup beside the measured ones; `staged-paper`
is staged with the paper's tree (decode.run --paper-tree) and no plan.
"""
import argparse
import datetime
import importlib.metadata
import json
import resource
import sys
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from decode.api import SpeculativeDecoder
from decode.atomic import FILE, check_output, check_room, write_json
from decode.benchmarking import explain, near_ties
from decode.benchmarking.comparison import compare_with_baseline
from decode.benchmarking.llama_server import SERVER_PEERS, TUNING_PROMPTS, ServerPeer, missing_reason, server_binary, server_build
from decode.benchmarking.peers import HF_PEERS, LLAMACPP_MISSING, LLAMACPP_PEERS, PEERS, HFGenerate, LlamaCpp, llamacpp_installed
from decode.benchmarking.plots import check_plot_path, pyplot, save
from decode.benchmarking.tables import print_table
from decode.cli.help import HelpFormatter
from decode.cli.settings import Settings, add_result_flags, encode_prompts, parse_settings
from decode.decoder import Decoder, require_draft
from decode.devices import device_name, machine_name
from decode.errors import InputError, exits_on_input_error
from decode.models.loading import check_same_vocabulary
from decode.models.quantized import format_name
from decode.options import PAPER_BUDGET, PAPER_WIDTHS
from decode.provenance import command_line, provenance
from decode.timing.turns import decode_in_turns, warm_up

OURS = ("baseline", "speculative", "tree", "staged", "staged-paper", "ngram", "lookup")
DEFAULT_METHODS = ",".join(OURS + PEERS)
PROG = "python -m decode.bench"


def check_draft(name: str, base) -> None:
    """A peer that drafts with our draft model: it is there, with the oracle's tokenizer."""
    check_same_vocabulary(base.oracle, require_draft(base.draft, name), "draft")


def build_methods(names: list[str], settings: Settings, chosen: bool) -> tuple[dict, list]:
    """A decoder per method (each with its own models and caches) and our SpeculativeDecoders. A llama.cpp peer that
    cannot run here is an error when `chosen` (named in --methods), else skipped with a line."""
    base = settings.flags.base
    decoders: dict[str, Any] = {}  # ours (api.Decoder) and the peers: each decodes a prompt when called
    ours: list[SpeculativeDecoder] = []
    for name in (n for n in names if n not in PEERS):
        options = (replace(base, method="staged", widths=list(PAPER_WIDTHS), budget=PAPER_BUDGET) if name == "staged-paper"
                   else settings.options_of(name))
        ours.append(SpeculativeDecoder(options))
        decoders[name] = ours[-1].decoder
    oracle = decoders["baseline"].oracle
    dtype, threads, eos_id = str(oracle.dtype).removeprefix("torch."), torch.get_num_threads(), decoders["baseline"].eos_id
    for name in (n for n in names if n in LLAMACPP_PEERS + SERVER_PEERS):
        try:
            if oracle.device.type != "cpu":
                raise InputError(f"{name} runs llama.cpp on the CPU, not on {oracle.device.type}")
            if name in SERVER_PEERS:
                if name == "llamacpp-draft":
                    check_draft(name, base)
                decoders[name] = ServerPeer(name, base.oracle, base.draft, settings.sampling, eos_id, dtype, threads,
                                            oracle.max_length, peer_draft_format(decoders))
                continue
            decoders[name] = LlamaCpp(base.oracle, settings.sampling, eos_id, dtype, threads,
                                      base.lookup_tokens if name == "llamacpp-lookup" else None)
        except InputError as e:
            if chosen:
                raise
            print(f"skipping {name}: {e}")
    for name in (n for n in names if n in HF_PEERS):
        if name == "hf-assisted":
            check_draft(name, base)
        decoders[name] = HFGenerate(base.oracle, base.draft if name == "hf-assisted" else None, settings.sampling,
                                    decoders["baseline"].stop_ids, base.dtype, base.device,
                                    base.lookup_tokens if name == "hf-lookup" else None)
    return decoders, ours


def timed_runs(decoders: dict, prompts: list, settings: Settings) -> dict[str, list[dict]]:
    """Every method on every prompt in turns, after a warm-up on the first prompt (first calls allocate, build
    kernels and fill caches); one record per method and prompt."""
    n, seed, sampling = settings.max_new_tokens, settings.seed, settings.sampling
    runs = {name: decoder if name in PEERS else partial(decoder, sampling=sampling) for name, decoder in decoders.items()}
    runs = {name: (lambda prompt, i, tokens, decode=decode: decode(prompt, tokens, seed + i)) for name, decode in runs.items()}
    for decoder in (d for d in decoders.values() if isinstance(d, ServerPeer)):
        chosen = decoder.choose([prompt for _, prompt in prompts[:TUNING_PROMPTS]], n)
        if chosen:
            print(chosen)
    warm_up(runs, prompts[0][1], n)
    records = decode_in_turns(runs, [prompt for _, prompt in prompts], n, progress="prompts")
    for rows in records.values():
        for row, (record, _) in zip(rows, prompts):
            row["task_id"] = record["task_id"]
    return records


def check_outputs(records: dict[str, list[dict]], prompts: list, decoders: dict, settings: Settings) -> dict[str, dict]:
    """Greedy: per method, prompts whose output equals the baseline's, near-ties, and differences that are not.
    A peer's difference is judged with its own model's logits too (transformers' kernels round otherwise), one
    of ours with the rows its own forwards computed (`near_ties.own_rows`, decoded again with the run's seed)."""
    n, seed = settings.max_new_tokens, settings.seed

    def judge(name, i, prompt, expected, got):
        peer = decoders[name] if name in PEERS else None
        own = None if name in PEERS else lambda: near_ties.own_rows(decoders[name], prompt, n, seed + i)
        return near_ties.divergence(decoders["baseline"].oracle, prompt, expected, got, peer, own)

    outputs = {name: [row["tokens"] for row in rows] for name, rows in records.items()}
    return compare_with_baseline(outputs, [prompt for _, prompt in prompts], [r["task_id"] for r, _ in prompts], judge)


def draft_of(model) -> dict:
    """How a method's draft was loaded: its precision as --draft-dtype names it, a block format where its weights
    were quantized (the plan may choose one other than the oracle's), and its output layer."""
    return {"dtype": format_name(model.runtime.quantization) or str(model.dtype).removeprefix("torch."),
            "vocabulary": f"its {len(model.shortlist)} most frequent tokens" if model.shortlist else "every token"}


RIVALS = ("speculative", "hf-assisted", "hf-lookup")  # what staged must also beat


def summarise(records: dict[str, list[dict]], checks: dict | None) -> dict[str, dict]:
    ms_per_token = {name: np.array([1e3 * r["seconds"] / len(r["tokens"]) for r in rows]) for name, rows in records.items()}
    base_ms = ms_per_token["baseline"]
    plain = explain.least_repetitive_half([r["tokens"] for r in records["baseline"]])
    summary = {}
    for name, rows in records.items():
        tokens = sum(len(r["tokens"]) for r in rows)
        calls = sum(r["oracle_calls"] for r in rows)
        s = {"tokens": tokens, "seconds": sum(r["seconds"] for r in rows),
             "tokens_per_oracle_call": tokens / calls, "oracle_calls_per_token": calls / tokens}
        s["tokens_per_second"] = tokens / s["seconds"]
        nodes = sum(r["oracle_nodes"] for r in rows)
        s["mean_oracle_batch"] = nodes / calls if nodes else None  # peers: not observed
        if checks is not None:
            s["same_output"] = checks[name]
        if checks is None or not checks[name]["differences"]:
            speedup = base_ms / ms_per_token[name]
            s["speedup"] = {"median": float(np.median(speedup)), "mean": float(speedup.mean()),
                            "min": float(speedup.min()), "max": float(speedup.max()),
                            "least_repetitive_half": float(np.median(speedup[plain])), "per_prompt": speedup.tolist()}
            s["median_speedup_over"] = {rival: float(np.median(ms_per_token[rival] / ms_per_token[name]))
                                        for rival in RIVALS if rival in records and rival != name}
        summary[name] = s
    return summary


def plot(summary: dict[str, dict], path: Path, title: str, overwrite: bool) -> None:
    plt = pyplot()
    names = [n for n, s in summary.items() if "speedup" in s and n != "baseline"]
    fig, ax = plt.subplots(figsize=(1.3 * len(names) + 2, 4))
    ax.boxplot([summary[n]["speedup"]["per_prompt"] for n in names], showmeans=True)
    ax.set_xticks(range(1, len(names) + 1), names, rotation=20)
    ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    ax.set_ylabel("speedup over baseline (per prompt)")
    ax.set_title(title)
    save(fig, path, overwrite)


def parse(argv) -> tuple[argparse.Namespace, list[str], Settings]:
    """bench's own flags, checked; the methods, the baseline first; and decode.run's flags, parsed."""
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter,
                                epilog="Every other flag is decode.run's (--run, --prompts, --limit, --max-new-tokens, "
                                       "--temperature, --top-k, --budget, --widths, --dtype, ...).")
    p.add_argument("--methods", help=f"comma-separated, from {', '.join(OURS + PEERS)} (default: all; the llama.cpp peers "
                                     f"where llama-cpp-python or llama-server is found)")
    add_result_flags(p, "the figures and per-prompt records", "the per-prompt speedup distribution per method")
    known, rest = p.parse_known_args(argv)
    names = (known.methods or DEFAULT_METHODS).split(",")
    unknown = [n for n in names if n not in OURS + PEERS]
    if unknown:
        p.error(f"unknown methods {unknown}; choose from {', '.join(OURS + PEERS)}")
    if not llamacpp_installed() and set(names) & set(LLAMACPP_PEERS):
        if known.methods:
            p.error(f"{', '.join(n for n in names if n in LLAMACPP_PEERS)}: {LLAMACPP_MISSING}")
        print(f"skipping {', '.join(LLAMACPP_PEERS)}: {LLAMACPP_MISSING}")
        names = [n for n in names if n not in LLAMACPP_PEERS]
    if server_binary() is None and set(names) & set(SERVER_PEERS):
        if known.methods:
            p.error(f"{', '.join(n for n in names if n in SERVER_PEERS)}: {missing_reason()}")
        print(f"skipping {', '.join(SERVER_PEERS)}: {missing_reason()}")
        names = [n for n in names if n not in SERVER_PEERS]
    settings = parse_settings(rest, PROG, __doc__.split("\n\n")[0])
    if known.out:
        check_output(known.out, FILE, known.overwrite, "--out", settings.reads())
    if known.plot:
        check_plot_path(known.plot, known.overwrite, settings.reads())
    return known, ["baseline"] + [n for n in names if n != "baseline"], settings


def describe_methods(decoders: dict, summary: dict, sampling) -> tuple[dict, dict]:
    """Print how big the staged trees were and how the draft was loaded; both, for the result."""
    sizing = {n: d.drafter.describe() | {"children": "sampled" if d.drafter.draws(sampling) else "top"}
              for n, d in decoders.items() if n.startswith("staged")}
    for name, size in sizing.items():
        over = ", ".join(f"{x:.2f}x over {rival}" for rival, x in summary[name].get("median_speedup_over", {}).items())
        tree = (f"oracle tree of {size['budget']} nodes" if "budget" in size else f"a fixed shape of {size['nodes']} nodes")
        tree += ", draws from the draft" if size["children"] == "sampled" else ""
        stages = f"trigram widths {size['widths']}" if size.get("widths") else "no stage below the draft"
        print(f"  {name}: {stages}, {tree}" + (f"; median {over}" if over else ""))
    drafts = {n: draft_of(d.draft) for n, d in decoders.items() if n in OURS and d.draft is not None}
    if drafts:
        print("  the draft: " + "; ".join(f"{name} {draft['dtype']}, {draft['vocabulary']}" for name, draft in drafts.items()))
    print()
    return sizing, drafts


def peak_memory(decoders: dict) -> dict[str, float]:
    """The peak resident memory (MiB) of each llama-server peer's server, where it could be read."""
    return {name: d.peak_rss for name, d in decoders.items() if isinstance(d, ServerPeer) and d.peak_rss}


def process_peak_rss_mb() -> float:
    """This process's peak resident memory so far, in MiB (Linux reports kilobytes, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (2**20 if sys.platform == "darwin" else 1024)


def draft_formats(decoders: dict) -> dict[str, str | None]:
    """Per method of ours that drafts with the draft model, the block format its draft's weights are in (None:
    unquantized): a plan may quantize the draft as it loads for one method and not another."""
    return {name: format_name(d.draft.runtime.quantization)
            for name, d in decoders.items() if isinstance(d, Decoder) and d.draft is not None}


def weight_formats(decoders: dict) -> dict[str, str | None]:
    """The block format of the oracle's and the draft's weights (None: unquantized), as our decoders loaded them, the
    draft's with the methods it is theirs for where the methods' differ; the llama.cpp peers read GGUF files of the
    same blocks."""
    oracle = format_name(next(d for d in decoders.values() if isinstance(d, Decoder)).oracle.runtime.quantization)
    drafts = draft_formats(decoders)
    if len(set(drafts.values())) > 1:
        by_format = {fmt: [name for name, f in drafts.items() if f == fmt] for fmt in drafts.values() if fmt}
        return {"oracle": oracle, "draft": "; ".join(f"{fmt} for {', '.join(names)}" for fmt, names in by_format.items())}
    return {"oracle": oracle} | ({"draft": next(iter(drafts.values()))} if drafts else {})


def peer_draft_format(decoders: dict) -> str | None:
    """The block format llamacpp-draft's draft is exported in: our speculative method's draft's (its counterpart),
    else the first drafting method's."""
    drafts = draft_formats(decoders)
    return drafts.get("speculative", next(iter(drafts.values()), None))


def peer_versions(names: list[str]) -> dict[str, str]:
    """The llama.cpp builds the run's peers used: llama-server's own version line, llama-cpp-python's version."""
    versions = {}
    if set(names) & set(SERVER_PEERS) and (binary := server_binary()) is not None:
        versions["llama_server"] = server_build(binary)
    if set(names) & set(LLAMACPP_PEERS) and llamacpp_installed():
        versions["llama_cpp_python"] = importlib.metadata.version("llama-cpp-python")
    return versions


def records_bytes(methods: int, prompts: int, max_new_tokens: int) -> int:
    """About how large --out grows, erring high: a record per method and prompt, its token ids at up to 8 bytes
    each in JSON beside 256 of timings and counts, and the summary and settings (64 KiB)."""
    return methods * prompts * (8 * max_new_tokens + 256) + 2**16


@exits_on_input_error
def main(argv=None) -> dict:
    known, names, settings = parse(argv)
    decoders, ours = build_methods(names, settings, chosen=known.methods is not None)
    options, sampling, plan_path = settings.flags.base, settings.sampling, settings.plan
    prompts = encode_prompts(settings, ours)
    if known.out:
        check_room(known.out, records_bytes(len(decoders), len(prompts), settings.max_new_tokens), "--out")
    mode, loops, healing = sampling.describe(), ours[0].decoder.oracle.runtime.loops(), "on" if options.token_healing else "off"
    print(f"{len(prompts)} prompts x {settings.max_new_tokens} new tokens, {mode}, {options.dtype} on {options.device}, "
          f"token healing {healing}, step loops in {loops}; methods: {', '.join(decoders)}; "
          + (f"plan {plan_path}" if plan_path else "no plan (python -m decode.plan writes one)"))
    try:
        records = timed_runs(decoders, prompts, settings)
        summary = summarise(records, check_outputs(records, prompts, decoders, settings) if sampling.greedy else None)
    finally:
        for decoder in (d for d in decoders.values() if isinstance(d, ServerPeer)):
            decoder.close()  # its server
    memory = peak_memory(decoders)
    for name, mib in memory.items():
        summary[name]["peak_rss_mb"] = mib
    plan = json.loads(Path(plan_path).read_text()) if plan_path is not None else None
    if plan is not None:
        for name in (n for n in names if n in plan["predicted"] and n != "baseline"):
            summary[name]["predicted"] = plan["predicted"][name]
    shown = next((n for n in ("staged", *names) if n in records and n != "baseline"), "baseline")
    record, prompt = prompts[0]
    explain.show_sample(record["prompt"], prompt.completion(ours[0].tokenizer, records[shown][0]["tokens"],
                                                           decoders["baseline"].stop_ids), shown)
    print_table(summary, sampling.greedy)
    sizing, drafts = describe_methods(decoders, summary, sampling)
    print("\n".join(explain.explain(summary, plan, sampling.greedy)))
    note = explain.calibration_length_note(plan, sum(len(prompt.ids) for _, prompt in prompts) / len(prompts))
    if note and explain.forecast_rows(summary):
        print(note)
    print(explain.loops_line([r["tokens"] for r in records["baseline"]], summary))
    warning = explain.looping([r["tokens"] for r in records["baseline"]]) if sampling.greedy else None
    if warning:
        print(warning)
    device = decoders["baseline"].oracle.device
    in_process = [name for name in decoders if name in LLAMACPP_PEERS]
    print(f"peak resident memory: this process {process_peak_rss_mb():.0f} MiB (all of our methods' models together"
          + (f", and {', '.join(in_process)}'s" if in_process else "") + ")"
          + "".join(f"; {name}'s server {mib:.0f} MiB" for name, mib in memory.items()))
    result = {"settings": {"mode": mode, "dtype": options.dtype, "device": options.device, "machine": machine_name(device),
                           "date": datetime.date.today().isoformat(),
                           "command": command_line(PROG, argv),
                           "prompts": len(prompts), "max_new_tokens": settings.max_new_tokens, "tree_sizes": sizing,
                           "drafts": drafts, "plan": plan_path and str(plan_path),
                           "token_healing": options.token_healing, "step_loops": loops,
                           "peak_rss_mb": process_peak_rss_mb(), "weights": weight_formats(decoders),
                           "llamacpp_flags": {n: " ".join(d.flags) for n, d in decoders.items() if n in SERVER_PEERS},
                           **provenance(), **peer_versions(names)},
              "summary": summary, "records": records}
    if known.out:
        write_json(known.out, result, known.overwrite, indent=1)
        print(f"figures: {known.out}")
    if known.plot:
        plot(summary, known.plot, f"oracle {options.oracle}, draft {options.draft} on {device_name(device)}\n{len(prompts)} "
                                  f"prompts x {settings.max_new_tokens} tokens, {mode}, {options.dtype}, token healing {healing}",
             known.overwrite)
        print(f"plot: {known.plot}")
    return result


if __name__ == "__main__":
    main()
