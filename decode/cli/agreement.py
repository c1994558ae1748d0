"""Does every method produce the baseline's output, and how many tokens does each oracle call yield?

    python -m decode.agreement --run RUN --methods speculative,tree,staged,ngram --limit 50

Greedy outputs must equal the baseline's token for token. Where one differs, the oracle's logit gap
between the two tokens at the first differing step tells a numerical near-tie from a bug: scored in
forwards of several sizes, with its cache written in forwards of several sizes (a batched forward may
round differently than a single-token one), a near-tie's gap lies within how far rounding moves the logits
there: the gap itself, or the logit of any of the oracle's best tokens (`rounding_noise`). Where the replays
do not settle it, the method decodes the prompt again recording its own forwards: the row that chose the
other token is a near-tie when it holds every one of the oracle's best logits within that rounding of the
baseline's (`own_moved`). With sampling, outputs are not compared (each method draws differently); tokens
per oracle call are still reported.
"""
import argparse
from pathlib import Path
from typing import Any

import numpy as np

from decode.api import SpeculativeDecoder
from decode.atomic import FILE, check_output, write_json
from decode.benchmarking.comparison import compare_with_baseline
from decode.benchmarking.near_ties import describe, divergence, own_rows
from decode.cli.help import HelpFormatter
from decode.cli.settings import encode_prompts, parse_settings
from decode.errors import exits_on_input_error
from decode.methods import METHODS

PROG = "python -m decode.agreement"


@exits_on_input_error
def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter,
                                epilog="Every other flag is decode.run's (--run, --prompts, --limit, --max-new-tokens, ...).")
    p.add_argument("--methods", default="speculative,tree,staged,ngram", help="comma-separated methods to compare with baseline")
    p.add_argument("--out", type=Path, help="write the per-prompt divergences and totals as JSON here")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    known, rest = p.parse_known_args(argv)
    methods = known.methods.split(",")
    unknown = [m for m in methods if m not in METHODS or m == "baseline"]
    if unknown:
        p.error(f"unknown methods {unknown}; choose from {', '.join(m for m in METHODS if m != 'baseline')}")
    settings = parse_settings(rest, PROG, __doc__.split("\n\n")[0])
    if known.out:
        check_output(known.out, FILE, known.overwrite, "--out", settings.reads())
    decoders = {m: SpeculativeDecoder(settings.options_of(m)) for m in ["baseline", *methods]}
    records, prompts = zip(*encode_prompts(settings, list(decoders.values())))
    n, seed, sampling = settings.max_new_tokens, settings.seed, settings.sampling
    outputs = {m: [dec.decoder(prompt, n, seed + i, sampling) for i, prompt in enumerate(prompts)]
               for m, dec in decoders.items()}
    report: dict[str, dict[str, Any]] = {
        m: {"tokens_per_oracle_call": [len(out.tokens) / out.oracle_calls for out in outputs[m]]} for m in methods}
    if sampling.greedy:  # sampled outputs differ by method (each draws differently): only greedy ones are compared
        judge = lambda m, i, prompt, expected, got: divergence(
            decoders["baseline"].decoder.oracle, prompt, expected, got,
            own=lambda: own_rows(decoders[m].decoder, prompt, n, seed + i))
        tokens = {m: [out.tokens for out in outs] for m, outs in outputs.items()}
        for m, check in compare_with_baseline(tokens, list(prompts), [r["task_id"] for r in records], judge).items():
            if m != "baseline":
                report[m].update(check)
    mode = "greedy" if sampling.greedy else f"T={sampling.temperature}, top-k {sampling.top_k}, top-p {sampling.top_p}"
    print(f"{len(prompts)} prompts x {n} new tokens, {mode}")
    print(f"{'method':<12} {'identical':>10} {'near-ties':>10} {'differences':>12} {'tokens/oracle call':>19}")
    for method, r in report.items():
        r["mean_tokens_per_oracle_call"] = float(np.mean(r["tokens_per_oracle_call"]))
        same = [f"{r['identical']}/{len(prompts)}", len(r["near_ties"]), len(r["differences"])] if sampling.greedy else ["-"] * 3
        print(f"{method:<12} {same[0]:>10} {same[1]:>10} {same[2]:>12} {r['mean_tokens_per_oracle_call']:>19.2f}")
        for diff in r.get("differences", []):
            print(f"  {method} differs from baseline on {diff['task_id']} at token {diff['position']} ({describe(diff)})")
    if known.out:
        write_json(known.out, report, known.overwrite)
    return report


if __name__ == "__main__":
    main()
