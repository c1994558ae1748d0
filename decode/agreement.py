"""Does every method produce the baseline's output, and how many tokens does each oracle call yield?

    python -m decode.agreement --run RUN --methods speculative,tree,staged,ngram --limit 50

Greedy outputs must equal the baseline's token for token. Where one differs, the oracle's top-2
logit gap at the first differing step tells a numerical near-tie (gap <= 1e-3 in float32: a batched
forward may round differently than a single-token one) from a bug. With sampling, outputs are not compared
(each method draws differently); tokens per oracle call are still reported.
"""
import argparse
import json
from pathlib import Path

import numpy as np
import torch

from data.atomic import FILE, atomic_output, check_output
from data.errors import exits_on_input_error
from decode import run
from decode.api import SpeculativeDecoder
from decode.healing import Prompt, constrain_first

# Largest top-2 logit gap a different batch shape may flip: float32 rounding is ~1e-6 relative;
# bfloat16 rounds every matmul output to 8 bits of mantissa (0.06 at logits of 8-16).
NEAR_TIE = {"float32": 1e-3, "bfloat16": 0.125}


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def top2_gap(oracle, context: list[int], allowed: torch.Tensor | None = None) -> float:
    """The oracle's logit margin between its two best next tokens after `context` (plain forward),
    among `allowed` tokens when given (a healed prompt's first token)."""
    oracle.reset()
    logits = constrain_first(oracle.extend(torch.tensor(context, device=oracle.device))[-1:], allowed)[0]
    top = logits.topk(2).values
    return float(top[0] - top[1])


def divergence(oracle, prompt: Prompt, expected: list[int], got: list[int], near_tie: float) -> dict | None:
    at = first_divergence(expected, got)
    if at is None:
        return None
    gap = top2_gap(oracle, prompt.ids.tolist() + expected[:at], prompt.allowed if at == 0 else None)
    return {"position": at, "expected": expected[at] if at < len(expected) else None,
            "got": got[at] if at < len(got) else None, "top2_gap": gap, "near_tie": gap <= near_tie}


@exits_on_input_error
def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m decode.agreement", description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", default="speculative,tree,staged,ngram", help="comma-separated methods to compare with baseline")
    p.add_argument("--report", type=Path, help="write the per-prompt divergences and totals as JSON here")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --report file")
    known, rest = p.parse_known_args(argv)
    if known.report:
        check_output(known.report, FILE, known.overwrite, "--report")
    methods = known.methods.split(",")
    unknown = [m for m in methods if m not in run.METHODS or m == "baseline"]
    if unknown:
        p.error(f"unknown methods {unknown}; choose from {', '.join(m for m in run.METHODS if m != 'baseline')}")
    base = run.parse(rest + ["--method", "baseline"])
    baseline = SpeculativeDecoder(base.options)
    decoders = {}
    for method in methods:
        decoders[method] = SpeculativeDecoder(run.parse(rest + ["--method", method]).options)
    for dec in [baseline, *decoders.values()]:
        dec.use(base.sampling)
    prompts = run.encode_prompts(base, [baseline, *decoders.values()])
    greedy = base.sampling.greedy
    report = {m: {"identical": 0, "near_ties": [], "bugs": [], "tokens_per_oracle_call": []} for m in methods}
    for i, (record, prompt) in enumerate(prompts):
        expected = baseline.decoder(prompt, base.max_new_tokens, base.seed + i).tokens
        for method, dec in decoders.items():
            out = dec.decoder(prompt, base.max_new_tokens, base.seed + i)
            report[method]["tokens_per_oracle_call"].append(len(out.tokens) / out.oracle_calls)
            if not greedy:
                continue
            diff = divergence(baseline.decoder.oracle, prompt, expected, out.tokens, NEAR_TIE[base.options.dtype])
            if diff is None:
                report[method]["identical"] += 1
            else:
                report[method]["near_ties" if diff["near_tie"] else "bugs"].append({"task_id": record["task_id"], **diff})
    sampling = base.sampling
    mode = "greedy" if greedy else f"T={sampling.temperature}, top-k {sampling.top_k}, top-p {sampling.top_p}"
    print(f"{len(prompts)} prompts x {base.max_new_tokens} new tokens, {mode}")
    print(f"{'method':<12} {'identical':>10} {'near-ties':>10} {'bugs':>6} {'tokens/oracle call':>19}")
    for method, r in report.items():
        r["mean_tokens_per_oracle_call"] = float(np.mean(r["tokens_per_oracle_call"]))
        same = f"{r['identical']}/{len(prompts)}" if greedy else "-"
        print(f"{method:<12} {same:>10} {len(r['near_ties']) if greedy else '-':>10} {len(r['bugs']) if greedy else '-':>6} "
              f"{r['mean_tokens_per_oracle_call']:>19.2f}")
        for bug in r["bugs"]:
            print(f"  {method} differs from baseline on {bug['task_id']} at token {bug['position']} "
                  f"(top-2 logit gap {bug['top2_gap']:.3g}: not a near-tie)")
    if known.report:
        with atomic_output(known.report, FILE, known.overwrite) as tmp:
            tmp.write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
