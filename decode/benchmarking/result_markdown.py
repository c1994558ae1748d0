"""The results other than decode.bench's, as the Markdown decode.report prints: decode.bench_engine's cost curves, a
plan's kinds of tree and its projection, decode.load's levels, decode.profile_step's steps of many requests at once,
decode.quantize's perplexities and decode.profile_start's start-up figures; each with the test that tells its kind."""
from decode.benchmarking import batch_steps
from decode.benchmarking.explain import interval_text
from decode.benchmarking.tables import curve_rows
from decode.errors import InputError
from decode.plan_file import describe
from decode.provenance import built_with


def is_quantization(result: dict) -> bool:
    """Whether a result is a quantized model's quantization.json (decode.quantize)."""
    return {"format", "bits_a_weight", "source"} <= result.keys()


def quantization_markdown(results: list[dict]) -> str:
    """Quantized models' perplexities beside their sources', a row a model, the commands that measured them above."""
    commands: dict[str, list[dict]] = {}
    for r in results:
        commands.setdefault(r["command"], []).append(r)
    lines = [f"- {' and '.join(r['model'] for r in made)} in {made[0]['format']}, perplexity on "
             f"{made[0]['perplexity']['tokens']} validation tokens, {made[0]['date']}: `{command}`"
             for command, made in commands.items()]
    rows = ["| model | format | bits a weight | perplexity, 16-bit | quantized | change |", "|---|---|---:|---:|---:|---:|"]
    for r in results:
        p = r["perplexity"]
        rows.append(f"| {r['source']} | {r['format']} | {r['bits_a_weight']} | {p['source']:.2f} | {p['quantized']:.2f} | "
                    f"{100 * (p['quantized'] / p['source'] - 1):+.2f}% |")
    return "\n".join(lines + [""] + rows)


def is_engine(result: dict) -> bool:
    """decode.bench_engine's result: a CPU's with its roofline, a GPU's with its forwards as CUDA graphs."""
    return {"forward_ms", "machine", "command"} <= result.keys()


def is_load(result: dict) -> bool:
    """decode.load's result."""
    return {"settings", "levels"} <= result.keys()


def is_startup(result: dict) -> bool:
    """decode.profile_start's result."""
    return {"settings", "startup"} <= result.keys()


def startup_markdown(result: dict) -> str:
    """decode.profile_start's medians: a row for the process that imports torch alone and one for decode.run."""
    s, figures = result["settings"], result["startup"]
    seconds = lambda value: "-" if value is None else f"{value:.2f} s"
    lines = [f"- medians of {s['repeats']} fresh processes each, taken in turns, on {s['machine']}, {s['date']}"
             f"{built_with(s)}. `{s['command']}`", "",
             "| process | models loaded | first new token | exit | peak resident memory |", "|---|---:|---:|---:|---:|"]
    for name in ("floor", "command"):
        m = figures[name]["median"]
        shown = s["floor"] if name == "floor" else s["decoding"]
        lines.append(f"| `{shown}` | {seconds(m['loaded'])} | {seconds(m['first_token'])} | {seconds(m['exit'])} | "
                     f"{m['peak_rss_mb']:.0f} MiB |")
    return "\n".join(lines)


def load_markdown(result: dict) -> str:
    """decode.load's levels: a row per engine and number of clients, each speed beside that engine's with one client."""
    s = result["settings"]
    lines = [f"- {s['prompts']} prompts x {s['max_new_tokens']} new tokens, {s['sampling']}, {s['dtype']} on "
             f"{s['machine']}, {s['date']}{built_with(s)}. `{s['command']}`", "",
             "| engine | clients | aggregate tok/s | x one client | request tok/s, median | x one client | "
             "first token p50 / p95 (s) |", "|---|---:|---:|---:|---:|---:|---:|"]
    alone = {row["engine"]: row for row in result["levels"] if row["clients"] == 1}
    for row in result["levels"]:
        one = alone.get(row["engine"])
        times = [f"{row[k] / one[k]:.2f}x" if one else "" for k in ("aggregate_tokens_per_s", "request_tokens_per_s")]
        lines.append(f"| {row['engine']} | {row['clients']} | {row['aggregate_tokens_per_s']:.1f} | {times[0]} | "
                     f"{row['request_tokens_per_s']:.1f} | {times[1]} | {row['first_token_p50_s']:.2f} / "
                     f"{row['first_token_p95_s']:.2f} |")
    return "\n".join(lines)


def is_batch_steps(result: dict) -> bool:
    """decode.profile_step's result (--concurrency --out)."""
    return {"settings", "batch_steps"} <= result.keys()


def batch_steps_markdown(result: dict) -> str:
    """decode.profile_step's levels: a column per number of requests at once, its steps' figures in rows, the ms of a
    step that reads no prompt followed by its parts'."""
    s = result["settings"]
    (label, levels), *rows = batch_steps.table(result["batch_steps"])
    return "\n".join([f"- {s['method']}, {s['prompts']} prompts x {s['max_new_tokens']} new tokens, {s['sampling']}, "
                      f"{s['dtype']} on {s['machine']}, {s['date']}{built_with(s)}. `{s['command']}`", "",
                      f"| {label} | {' | '.join(levels)} |", "|---|" + "---:|" * len(levels),
                      *(f"| {name} | {' | '.join(values)} |" for name, values in rows)])


def is_plan(result: dict) -> bool:
    """A plan (decode.plan's file)."""
    return {"version", "identity", "predicted"} <= result.keys()


def plan_markdown(plan: dict) -> str:
    """A plan's table of each kind of tree at its best, its policies for each load where it holds them
    (--concurrency), and its projection where it holds one (--project-oracle)."""
    parts = [kinds_markdown(plan)] if plan.get("kinds") else []
    parts += [loads_markdown(plan["concurrency"], "the plan")] if plan.get("concurrency") else []
    parts += [projection_markdown(plan)] if "projection" in plan else []
    if not parts:
        raise InputError("this plan holds neither a table of the kinds of tree nor a projection: make it again with "
                         "this version's decode.plan (--project-oracle for a projection)")
    return "\n\n".join(parts)


def kinds_markdown(plan: dict) -> str:
    """Each kind of tree at its best under the plan's costs (planning.kinds), the calibration in a line above."""
    one_row = plan["costs"]["oracle_ms"]["1"]
    lines = [f"- each kind of tree at its best: {plan['sampling']}, calibrated on {plan['calibration']['count']} prompts x "
             f"{plan['calibration']['max_new_tokens']} tokens, {plan['identity']['dtype']} on {plan['identity']['device']}; the "
             f"oracle's cost of a call in one-row forwards of {one_row:.2f} ms",
             "", "| kind | method | nodes | tokens/call | oracle cost/call | drafting ms/call | speedup | policy |",
             "|---|---|---:|---:|---:|---:|---:|---|"]
    for r in plan["kinds"]:
        lines.append(f"| {r['kind']} | {r['method']} | {r['nodes']:.1f} | {r['tokens_per_call']:.2f} | "
                     f"{r['oracle_forwards_per_call']:.2f}x | {r['drafting_ms_per_call']:.3f} | {r['speedup']:.2f}x | "
                     f"{describe(r['policy'])} |")
    return "\n".join(lines)


def projection_markdown(plan: dict) -> str:
    """A plan's projection: the shapes and where each part of it comes from in a list, then per method the projected
    tokens per oracle call, ms per token, speedup (with its 90% interval) and policy."""
    p = plan["projection"]
    n_layer, n_embd, vocab = p["shape"]
    draft = (f"a {p['draft']}-shaped draft ({p['draft_shape'][0]} x {p['draft_shape'][1]}, vocabulary "
             f"{p['draft_shape'][2]})" if "draft" in p else "the run's draft")
    lines = [f"- a projection, not a measurement: a {p['oracle']}-shaped oracle ({n_layer} x {n_embd}, vocabulary "
             f"{vocab}; one-row forward {p['oracle_ms']['1']:.1f} ms) with {draft}, {plan['sampling']}, calibrated on "
             f"{plan['calibration']['count']} prompts x {plan['calibration']['max_new_tokens']} tokens, "
             f"{plan['identity']['dtype']}, on {p['machine']}, {p['date']}{built_with(p)}. `{p['command']}`"]
    lines += [f"- {source}: {', '.join(parts)}" for source, parts in p.get("sources", {}).items()]
    lines += ["", "| method | tokens/call | ms/token | speedup (90% interval) | policy |", "|---|---:|---:|---:|---|"]
    for method, f in p["predicted"].items():
        spread = interval_text(f.get("speedup_interval"))
        lines.append(f"| {method} | {f['tokens_per_call']:.2f} | {f['ms_per_token']:.1f} | {f['speedup']:.2f}x{spread} "
                     f"| {describe(f.get('policy', {}))} |")
    if p.get("concurrency"):
        lines += ["", loads_markdown(p["concurrency"], f"the {p['oracle']}-shaped oracle's projection", ".1f")]
    return "\n".join(lines)


def loads_markdown(levels: dict, whose: str, ms: str = ".3f") -> str:
    """A plan's policies for several requests in flight (decode.plan --concurrency): per level and method, the
    forecast tokens per oracle call, each request's share of the ms per token (formatted `ms`), the speedup over plain
    decoding at the same load, and the policy."""
    lines = [f"- {whose} at each number of requests in flight, their trees scored in one forward: each request's "
             f"share of the time; speedups over plain decoding at the same load", "",
             "| in flight | method | tokens/call | ms/token | speedup | policy |", "|---:|---|---:|---:|---:|---|"]
    lines += [f"| {n} | {method} | {f['tokens_per_call']:.2f} | {f['ms_per_token']:{ms}} | {f['speedup']:.2f}x | "
              f"{describe(f.get('policy', {}))} |"
              for n, level in levels.items() for method, f in level["predicted"].items()]
    return "\n".join(lines)


def engine_markdown(result: dict) -> str:
    """decode.bench_engine's cost curves: the machine's roofline in a line, then a table per model and cached length
    of each way's milliseconds, c(q)/c(1), the roofline's and each way's share of it; on a GPU, which has no
    roofline measured, `graphs_markdown`."""
    if "roofline" not in result:
        return graphs_markdown(result)
    roofline = result["roofline"]
    weights = f", {result['weights']} weights" if result.get("weights") else ""
    lines = [f"- {result['dtype']}{weights} on {result['machine']}, {result['date']}{built_with(result)}: memory "
             f"{roofline['bandwidth_gb_s']:.1f} GB/s, peak {roofline['peak_gmac_s']:.1f} GMAC/s ({roofline['peak_dtype']} "
             f"products). `{result['command']}`"]
    for name, curve in roofline["curves"].items():
        rows = curve_rows(curve)
        counts = list(rows[0][1])
        model, prefix = name.rsplit(" @ ", 1)
        lines += ["", f"{model}, after {prefix} cached positions:", "",
                  "| q | " + " | ".join(str(q) for q in counts) + " |", "|---|" + "---:|" * len(counts)]
        lines += [f"| {label.strip()} | " + " | ".join(f"{row[q]:.2f}" for q in counts) + " |" for label, row in rows]
    return "\n".join(lines)


# The ways a GPU's bench_engine result times the forwards again, by the key of their entries (generation_with_KEY,
# forward_ms_with_KEY), and as its tables name them
REPLAYED = {"cuda_graphs": "with CUDA graphs", "compiled_layers": "with CUDA graphs and compiled layers"}


def graphs_markdown(result: dict) -> str:
    """decode.bench_engine's result on a GPU: greedy decoding's time a token against transformers' generate, with and
    without CUDA graphs (and with them and compiled layers, where measured), then a table per model of a forward's
    milliseconds by new nodes q, each way (a way's decoding time where the result holds it)."""
    generation = result["generation"]
    ways = {key: way for key, way in REPLAYED.items() if f"forward_ms_with_{key}" in result}
    with_graphs = "".join(f"; {way} {result[f'generation_with_{key}']['ours_ms_per_token']:.2f} ms" for key, way in ways.items()
                          if f"generation_with_{key}" in result)
    lines = [f"- {result['dtype']} on {result['machine']}, {result['date']}{built_with(result)}: greedy decoding "
             f"{generation['ours_ms_per_token']:.2f} ms a token without CUDA graphs{with_graphs}; transformers' generate "
             f"{generation['hf_generate_ms_per_token']:.2f} ms. `{result['command']}`"]
    for model, plain in result["forward_ms"].items():
        rows = {"ms": plain}
        for key, way in ways.items():
            captured = result[f"forward_ms_with_{key}"][model]
            rows |= {f"{way} ms": captured, f"{way} / without": {q: captured[q] / plain[q] for q in plain}}
        lines += ["", f"{model}, a forward of q new nodes:", "", "| q | " + " | ".join(plain) + " |",
                  "|---|" + "---:|" * len(plain)]
        lines += [f"| {label} | " + " | ".join(f"{row[q]:.2f}" for q in plain) + " |" for label, row in rows.items()]
    return "\n".join(lines)
