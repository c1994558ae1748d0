"""The tables a benchmark's results print as, on the terminal and again from their JSON (decode.report): the
methods' speeds and outputs (decode.bench) and the forward's cost curves beside the roofline (decode.bench_engine)."""
from decode.benchmarking import explain, near_ties
from decode.timing.forwards import NODE_COUNTS


def print_table(summary: dict[str, dict], greedy: bool) -> None:
    print(f"{'method':<15} {'tokens/s':>9} {'speedup median (mean, min-max)':>31} {'least rep. half':>15} "
          f"{'tokens/call':>11} {'calls/token':>11} {'batch':>6}" + (f" {'same output':>12}" if greedy else ""))
    for name, s in summary.items():
        if "speedup" in s:
            sp = s["speedup"]
            speed, plain = f"{sp['median']:.2f}x ({sp['mean']:.2f}, {sp['min']:.2f}-{sp['max']:.2f})", f"{sp['least_repetitive_half']:.2f}x"
        else:
            speed, plain = "refused: output differs", "-"
        batch = f"{s['mean_oracle_batch']:6.1f}" if s["mean_oracle_batch"] else f"{'-':>6}"
        line = (f"{name:<15} {s['tokens_per_second']:9.1f} {speed:>31} {plain:>15} {s['tokens_per_oracle_call']:11.2f} "
                f"{s['oracle_calls_per_token']:11.3f} {batch}")
        if greedy:
            same = s["same_output"]
            n = same["identical"] + len(same["near_ties"]) + len(same["differences"])
            line += f" {same['identical']:>5}/{n}" + (f" +{len(same['near_ties'])} ties" if same["near_ties"] else "")
        print(line)
    planned = explain.forecast_rows(summary)
    if planned:
        print(f"{'planned against measured:':<42} {'method':<12} {'tokens/call':>19} {'speedup (tokens/s)':>19}"
              "  (the plan's 90% interval: its calibration prompts and timing)")
        for row in planned:
            spread = explain.interval_text(row["interval"])
            (tokens, measured_tokens), (speedup, measured) = row["tokens_per_call"], row["speedup"]
            print(f"{'':<42} {row['method']:<12} {tokens:8.2f} vs {measured_tokens:5.2f}"
                  f"    {speedup:6.2f}x vs {measured:5.2f}x{spread}")
    for name, s in summary.items():
        for d in s.get("same_output", {}).get("differences", []):
            print(f"  {name} differs from baseline on {d['task_id']} at token {d['position']} "
                  f"({near_ties.describe(d)})")


def table_row(label: str, values: dict[int, float]) -> str:
    """A label (its last 40 characters) and a value per node count, '-' where there is none."""
    return f"{label[-40:]:<40}" + "".join(f"{values[q]:8.2f}" if q in values else f"{'-':>8}" for q in NODE_COUNTS)


def curve_rows(curve: dict) -> list[tuple[str, dict[int, float]]]:
    """A cost curve's rows, labelled: each way's milliseconds and c(q)/c(1), the roofline's, and each way's share of
    the roofline (its time over the measured one). Node counts as ints, from a result or from its JSON."""
    as_ints = lambda row: {int(q): t for q, t in row.items()}
    roof, rows = as_ints(curve["roofline_ms"]), []
    ways = {way: as_ints(row) for way, row in curve["ms"].items()}
    for way, row in ways.items():
        rows += [(f"{way} ms", row), (f"  {way} c(q)/c(1)", {q: t / row[1] for q, t in row.items()})]
    rows += [("roofline ms", roof), ("  roofline c(q)/c(1)", {q: t / roof[1] for q, t in roof.items()})]
    rows += [(f"  {way}'s share of the roofline", {q: roof[q] / t for q, t in row.items()}) for way, row in ways.items()]
    return rows
