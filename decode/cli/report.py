"""What a benchmark run means, in sentences a newcomer can read: one prompt with its completion, and
after the table how many outputs matched, how many tokens an oracle call yielded, the measured
speedup of staged decoding, the plan's forecast for a GPT-2-L-sized oracle, when staged lost why in
numbers, and when the oracle's completions loop a warning that they flatter every drafter.

    python -m decode.report greedy.json                      # decode.bench's table again, from its JSON
    python -m decode.report greedy.json topk.json --markdown # one Markdown table, a column group per run
    python -m decode.report greedy.json topk.json --markdown --brief --methods baseline,staged,llamacpp
    python -m decode.report greedy.json --markdown --forecast # the plan's forecast beside the measurement
    python -m decode.report engine.json --markdown           # decode.bench_engine's cost curves against the roofline
    python -m decode.report RUN/plan.json --markdown         # a plan's kinds of tree, and its projection
    python -m decode.report greedy.json topk.json --markdown --defaults  # what decoding takes without a plan

The benchmark guide's tables are made by the second form and the README's by the third (the median speedup alone,
the rows chosen), so no figure there is typed by hand.
"""
import argparse
import json
from pathlib import Path

from decode.benchmarking.explain import forecast_rows, interval_text, loop_share
from decode.benchmarking.peers import PEERS
from decode.benchmarking.result_markdown import (
    batch_steps_markdown,
    engine_markdown,
    is_batch_steps,
    is_engine,
    is_load,
    is_plan,
    is_quantization,
    is_startup,
    load_markdown,
    plan_markdown,
    quantization_markdown,
    startup_markdown,
)
from decode.benchmarking.tables import print_table
from decode.cli.help import HelpFormatter
from decode.errors import InputError, exits_on_input_error
from decode.options import DecoderOptions, default_tree
from decode.plan_file import default_policy, unplanned_method
from decode.provenance import built_with
from decode.sampling import GREEDY, Sampling

PROG = "python -m decode.report"


WHAT = "pass the JSON that python -m decode.bench (or decode.bench_engine) --out wrote, or a plan decode.plan wrote"
# The results shown alone, each by its Markdown: the test that tells its kind and what makes the table
ALONE = [(is_engine, engine_markdown), (is_load, load_markdown), (is_startup, startup_markdown),
         (is_batch_steps, batch_steps_markdown), (is_plan, plan_markdown)]


def load_result(path: Path) -> dict:
    """decode.bench's JSON (--out), or decode.bench_engine's, checked for what a table needs."""
    try:
        result = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise InputError(f"{path}: no such file; {WHAT}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InputError(f"{path}: not a benchmark result ({e}); {WHAT}") from None
    if not isinstance(result, dict) or not ({"settings", "summary", "records"} <= result.keys() or is_quantization(result)
                                            or any(test(result) for test, _ in ALONE)):
        raise InputError(f"{path}: not a benchmark result (neither decode.bench's settings, summary and records, nor "
                         f"decode.bench_engine's roofline, nor a plan, nor decode.quantize's report, nor decode.load's "
                         f"levels, nor decode.profile_step's or decode.profile_start's figures); {WHAT}")
    if is_quantization(result) and "perplexity" not in result:
        raise InputError(f"{path}: a quantized model's report without perplexity; quantize with --run RUN or --data DIR")
    return result


def describe_run(result: dict) -> str:
    """One line: what ran, where, when, and the command that makes it again."""
    s = result["settings"]
    loops, n = loop_share([r["tokens"] for r in result["records"]["baseline"]])
    where = s.get("machine", s["device"])
    when = f", {s['date']}" if "date" in s else ""
    plan = "planned" if s.get("plan") else "no plan"
    quantized = {role: name for role, name in s.get("weights", {}).items() if name}
    formats = "".join(f", {name} {' and '.join(r for r in quantized if quantized[r] == name)}"
                      for name in dict.fromkeys(quantized.values()))  # e.g. ", q8_0 oracle and draft"
    line = (f"{s['mode']}: {s['prompts']} prompts x {s['max_new_tokens']} tokens, {s['dtype']}{formats}, {plan}, on {where}{when}"
            f"{built_with(s)}; "
            f"{loops} of {n} baseline completions end in a loop")
    flagged = {name: flags for name, flags in s.get("llamacpp_flags", {}).items() if flags}  # plain decoding has none
    if flagged:
        line += "; llama.cpp's settings: " + ", ".join(f"{name} `{flags}`" for name, flags in flagged.items())
    if "peak_rss_mb" in s:
        servers = {name: m["peak_rss_mb"] for name, m in result["summary"].items() if "peak_rss_mb" in m}
        line += (f"; peak resident memory: the bench {s['peak_rss_mb']:.0f} MiB"
                 + "".join(f", {name}'s server {mib:.0f} MiB" for name, mib in servers.items()))
    return line + (f". `{s['command']}`" if "command" in s else "")


def columns_of(result: dict, brief: bool, over: str | None) -> list[str]:
    greedy = result["settings"]["mode"] == "greedy"
    speedup = "speedup" if brief else "speedup median (mean, min-max)"
    return (["tok/s", speedup, "least repetitive half"] + ([] if brief else ["tokens/call"])
            + (["same output"] if greedy else []) + ([f"over {over}, per prompt"] if over else []) + ["drafts"])


def shape_of(name: str, summary: dict, settings: dict) -> str:
    """What a method drafted, in words: its planned policy's shape (a chain of k, a tree of n nodes, the trigram's
    widths below it, the lookup's length), or the tree size the bench recorded; "-" for plain decoding and peers."""
    policy = summary.get("predicted", {}).get("policy")
    if policy is None:
        size = settings.get("tree_sizes", {}).get(name, {})
        return f"{size['nodes']} nodes" if "nodes" in size else f"budget {size['budget']}" if "budget" in size else "-"
    if "k" in policy:
        return f"chain of {policy['k']}"
    if "tokens" in policy:
        return f"lookup of {policy['tokens']}"
    widths = "x".join(map(str, policy.get("widths") or []))
    if "parents" in policy:  # a planned shape
        chain = policy["parents"] == list(range(-1, len(policy["parents"]) - 1))
        shape = f"chain of {policy['depth']}" if chain else f"tree of {policy['nodes'] - 1}"
    else:  # a tree of this many nodes, grown where the drafts are likeliest
        shape = f"tree of {policy['budget']}"
    return shape + (f", trigram widths {widths}" if widths else "")


def cells(name: str, result: dict, brief: bool, over: str | None) -> list[str]:
    """One method's cells in one run's column group."""
    summary, greedy = result["summary"].get(name), result["settings"]["mode"] == "greedy"
    if summary is None:
        return ["-"] * (4 + (not brief) + greedy + bool(over))
    sp = summary.get("speedup")
    if not sp:
        speed = "refused: output differs"
    else:
        speed = f"{sp['median']:.2f}x" + ("" if brief else f" ({sp['mean']:.2f}, {sp['min']:.2f}-{sp['max']:.2f})")
    plain = f"{sp['least_repetitive_half']:.2f}x" if sp and "least_repetitive_half" in sp else "-"
    row = [f"{summary['tokens_per_second']:.1f}", speed, plain] + ([] if brief else [f"{summary['tokens_per_oracle_call']:.2f}"])
    if greedy:
        same = summary["same_output"]
        n = same["identical"] + len(same["near_ties"]) + len(same["differences"])
        row.append(f"{same['identical']}/{n}" + (f" + {len(same['near_ties'])} ties" if same["near_ties"] else ""))
    if over:
        ratio = summary.get("median_speedup_over", {}).get(over)
        row.append(f"{ratio:.2f}x" if ratio is not None else "-")
    return row + [shape_of(name, summary, result["settings"])]


def markdown_table(results: list[dict], methods: list[str] | None = None, brief: bool = False,
                   over: str | None = None) -> str:
    """The runs' methods (`methods`, in that order; default: every one) as rows, each run's tokens/s, median speedup
    (with its mean, min-max unless `brief`), over the least repetitive half, tokens per oracle call (unless `brief`),
    when greedy outputs equal to the baseline's, and with `over` the median per prompt over that method where the
    benchmark recorded it, as column groups."""
    methods = methods or list(dict.fromkeys(name for result in results for name in result["summary"]))
    header, rule = ["method"], ["---"]
    for result in results:
        columns = columns_of(result, brief, over)
        mode = "greedy" if result["settings"]["mode"] == "greedy" else "sampled"
        header += [f"{mode}: {columns[0]}"] + columns[1:]
        rule += ["---" if column == "drafts" else "---:" for column in columns]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(rule) + "|"]
    for name in methods:
        row = [name]
        for result in results:
            row += cells(name, result, brief, over)
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def forecast_markdown(results: list[dict]) -> str:
    """Each run's planned methods, the plan's forecast beside the measurement: tokens per oracle call, and the
    speedup in tokens/s over the baseline's (with the plan's 90% interval where it has one)."""
    lines = []
    for result in results:
        lines += [f"- {describe_run(result)}", "", "| method | tokens/call: forecast | measured | speedup in tokens/s "
                  "(not the per-prompt median): forecast | measured |", "|---|---:|---:|---:|---:|"]
        for row in forecast_rows(result["summary"]):
            spread = interval_text(row["interval"])
            (tokens, measured_tokens), (speedup, measured) = row["tokens_per_call"], row["speedup"]
            lines.append(f"| {row['method']} | {tokens:.2f} | {measured_tokens:.2f} | {speedup:.2f}x{spread} | {measured:.2f}x |")
        lines.append("")
    return "\n".join(lines).rstrip()


def best_markdown(results: list[dict]) -> str:
    """Which method to use, a row per run: its machine and decoding setting, our method with the highest median
    speedup over plain decoding (plain decoding itself where none is above one), what it drafted, and the runner-up."""
    lines = ["| machine | decoding | use | median speedup | drafts | next |", "|---|---|---|---:|---|---|"]
    for result in results:
        s, summary = result["settings"], result["summary"]
        ours = {name: m["speedup"]["median"] for name, m in summary.items()
                if name != "baseline" and name not in PEERS and m.get("speedup")}
        ranked = sorted(ours, key=ours.__getitem__, reverse=True)
        use = ranked[0] if ranked and ours[ranked[0]] > 1 else "baseline"
        shown = ranked[1:2] if use != "baseline" else ranked[:1]
        runner_up = ", ".join(f"{name} {ours[name]:.2f}x" for name in shown) or "-"
        speedup = f"{ours[use]:.2f}x" if use != "baseline" else "1.00x"
        drafts = shape_of(use, summary[use], s) if use != "baseline" else "-"
        lines.append(f"| {s.get('machine', s['device'])} | {s['mode']} | {use} | {speedup} | {drafts} | {runner_up} |")
    return "\n".join(lines)


def defaults_markdown(results: list[dict]) -> str:
    """What decoding takes without a plan (the default method and its tree, decode.plan_file) on each run's device and
    setting, and its median speedup there: from the run's row of that method, decoded without a plan or planned to
    the very same drafting."""
    lines = ["| machine | decoding | without a plan | drafts | median speedup | measured |", "|---|---|---|---|---:|---|"]
    for result in results:
        s = result["settings"]
        options = DecoderOptions(oracle=Path(), device=s["device"])
        sampling = GREEDY if s["mode"] == "greedy" else Sampling(1.0)
        method = unplanned_method(options, sampling=sampling)
        budget, widths = default_tree(s["device"])
        default = ({"tokens": options.lookup_tokens} if method == "lookup"
                   else default_policy(options, sampling=sampling) or {"widths": widths, "budget": budget})
        drafts = "-" if method == "baseline" else shape_of(method, {"predicted": {"policy": default}}, {})
        row = result["summary"].get(method)
        planned = row and row.get("predicted", {}).get("policy")
        if row is None or not row.get("speedup") or (planned and (shape_of(method, row, s) != drafts or any(
                planned.get(key, value) != value for key, value in (("draft_vocab", 0), ("draft_calls", 1))))):
            raise InputError(f"{s['command']}: holds no {method} row decoded as it is without a plan ({drafts})")
        measured = "no plan" if not planned else "planned to the same drafting"
        lines.append(f"| {s.get('machine', s['device'])} | {s['mode']} | {method} | {drafts} | "
                     f"{row['speedup']['median']:.2f}x | {measured} |")
    return "\n".join(lines)


def markdown(results: list[dict], methods: list[str] | None = None, brief: bool = False, over: str | None = None) -> str:
    """The runs described one per line, then their table."""
    return ("\n".join(f"- {describe_run(result)}" for result in results) + "\n\n"
            + markdown_table(results, methods, brief, over))


@exits_on_input_error
def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog=PROG, description="Print a decode.bench result (its --out JSON) as a table, or a "
                                "decode.bench_engine result's cost curves, a plan's kinds of tree and projection, or "
                                "quantized models' perplexities (decode.quantize's quantization.json) as Markdown.",
                                formatter_class=HelpFormatter)
    p.add_argument("results", nargs="+", type=Path, metavar="RESULT.json",
                   help="decode.bench --out files, one table; or one decode.bench_engine, decode.load or "
                        "decode.profile_start --out file, one plan, or decode.quantize's reports, as Markdown")
    p.add_argument("--markdown", action="store_true", help="a Markdown table, the runs' settings listed above it")
    p.add_argument("--brief", action="store_true", help="with --markdown: the median speedup alone, no tokens per call")
    p.add_argument("--methods", help="with --markdown: these rows, comma-separated, in this order (default: every method)")
    p.add_argument("--over", metavar="METHOD", help="with --markdown: a column of each method's median speedup per "
                                                    "prompt over METHOD, where the benchmark recorded it")
    p.add_argument("--forecast", action="store_true", help="with --markdown: the plan's forecast beside the measurement, "
                                                             "for each planned method")
    p.add_argument("--best", action="store_true", help="with --markdown: which method to use, a row per result: our "
                                                         "fastest method by median speedup, its shape and the next")
    p.add_argument("--defaults", action="store_true", help="with --markdown: what decoding takes without a plan on each "
                                                             "result's device and setting, and its median speedup there")
    args = p.parse_args(argv)
    results = [load_result(path) for path in args.results]
    # the kinds that have a Markdown table alone print it whether or not --markdown is typed
    if any(is_quantization(result) for result in results):
        if not all(is_quantization(result) for result in results):
            raise InputError("decode.quantize's reports are shown together, with no other result")
        print(quantization_markdown(results))
        return
    alone = [shown for result in results for test, shown in ALONE if test(result)]
    if alone:
        if len(results) > 1:
            raise InputError("a decode.bench_engine, decode.load, decode.profile_step or decode.profile_start result, "
                             "or a plan, is shown alone: pass one")
        print(alone[0](results[0]))
        return
    methods = args.methods.split(",") if args.methods else None
    unknown = [m for m in methods or [] if not any(m in result["summary"] for result in results)]
    if unknown:
        raise InputError(f"--methods {','.join(unknown)}: not in these results; they hold "
                         f"{', '.join(dict.fromkeys(m for result in results for m in result['summary']))}")
    if args.markdown:
        print(forecast_markdown(results) if args.forecast else best_markdown(results) if args.best
              else defaults_markdown(results) if args.defaults else markdown(results, methods, args.brief, args.over))
        return
    for path, result in zip(args.results, results):
        print(f"{path}: {describe_run(result)}")
        print_table(result["summary"], result["settings"]["mode"] == "greedy")


if __name__ == "__main__":
    main()
