"""What a benchmark run means, in sentences a newcomer can read (decode.bench prints them, decode.report again from
its JSON): one prompt with its completion, and after the table how many outputs matched, how many tokens an oracle
call yielded, the measured speedup of staged decoding, the plan's forecast, when staged lost why in numbers, and when
the oracle's completions loop a warning that they flatter every drafter."""
from decode.benchmarking.peers import PEERS


def show_sample(prompt_text: str, completion: str, method: str) -> None:
    print(f"--- a prompt and its {method} completion (greedy output is the oracle's own) ---")
    print(prompt_text + abridged(completion))
    print("---")


def abridged(text: str, shown: int = 3, longest: int = 80) -> str:
    """`text` cut `shown` periods into the longest tail that repeats one stretch of at most `longest`
    characters, with a line saying how much was cut: a looping completion in three lines, not sixty."""
    start, period = len(text), 0
    for p in range(1, min(longest, len(text) // 2) + 1):
        s = len(text) - p
        while s > 0 and text[s - 1] == text[s - 1 + p]:
            s -= 1
        if s < start and len(text) - s - shown * p >= max(2 * p, longest):  # worth cutting: a few periods, a line or more
            start, period = s, p
    if not period:
        return text
    cut = start + shown * period
    return (text[:cut] + ("" if text[cut - 1] == "\n" else "\n")
            + f"... ({len(text) - cut} more characters repeating the last {period}: this oracle loops)")


def explain(summary: dict, plan: dict | None, greedy: bool, staged: str = "staged") -> list[str]:
    """Plain sentences built from the run's own figures (`summary`: decode.bench's) and the plan."""
    lines = []
    ours = [name for name in summary if name != "baseline" and name not in PEERS]
    if greedy and ours:
        n = summary["baseline"]["same_output"]["identical"]
        same = {name: summary[name]["same_output"] for name in ours}
        exact = [name for name, s in same.items() if not s["differences"] and not s["near_ties"]]
        ties = sum(len(s["near_ties"]) for s in same.values())
        lines.append(f"Same output: {len(exact)} of {len(ours)} speculative methods gave exactly the baseline's tokens on "
                     f"all {n} prompts" + (f"; the others differ only where the oracle's two best tokens tie within "
                                           f"bfloat16 rounding ({ties} prompt-method pairs)" if ties else "") + ".")
    calls = ", ".join(f"{name} {summary[name]['tokens_per_oracle_call']:.2f}" for name in ours)
    if calls:
        lines.append(f"Tokens per oracle call (the baseline: 1): {calls}.")
    if staged in summary:
        s, base = summary[staged], summary["baseline"]
        ratio = s["tokens_per_second"] / base["tokens_per_second"]
        planned = "planned " if plan is not None else ""
        lines.append(f"Measured here: {planned}staged decoding ran at {s['tokens_per_second']:.0f} tokens/s, "
                     f"{ratio:.2f}x the baseline's {base['tokens_per_second']:.0f} tokens/s.")
        if ratio < 1:
            lines.append(why_slower(s, base, plan))
    if plan is not None and "projection" in plan:
        projection = plan["projection"]
        best = max((m for m in projection["predicted"] if m != "baseline"),
                   key=lambda m: projection["predicted"][m]["speedup"])
        p = projection["predicted"]
        lines.append(f"Forecast, not a measurement: with a {projection['oracle']}-sized oracle on this machine "
                     f"({p['baseline']['ms_per_token']:.0f} ms per token alone) and these drafters, the plan predicts "
                     f"staged {p['staged']['speedup']:.2f}x" + (f" and {best} {p[best]['speedup']:.2f}x" if best != "staged" else "")
                     + " (python -m decode.plan --project-oracle).")
    return lines


def why_slower(staged: dict, base: dict, plan: dict | None) -> str:
    """One line: what an oracle call costs against what a staged step adds."""
    one_token_ms = 1e3 / base["tokens_per_second"]
    step_ms = 1e3 * staged["tokens_per_oracle_call"] / staged["tokens_per_second"]
    line = (f"Why slower: an oracle call costs only {one_token_ms:.2f} ms here, and a staged step took {step_ms:.2f} ms "
            f"for {staged['tokens_per_oracle_call']:.2f} tokens")
    if plan is not None:
        p = plan["predicted"]["staged"]
        line += (f" (planned: the oracle's forward over the tree {p['oracle_ms_per_call']:.2f} ms, the draft and the "
                 f"trees {p['drafting_ms_per_call']:.2f} ms)")
    return line + "; speculation pays when an oracle call costs far more than drafting, as it does for large oracles."


LONGEST_LOOP = 32  # tokens: the longest period a loop is looked for with


def loop_period(tokens: list[int], longest: int = LONGEST_LOOP) -> int | None:
    """The period of the loop a completion ends in: the shortest p <= `longest` tokens whose repetition covers at
    least half of it, twice or more; None where it does not end in one."""
    n = len(tokens)
    for p in range(1, min(longest, n // 2) + 1):
        start = n - p
        while start > 0 and tokens[start - 1] == tokens[start - 1 + p]:
            start -= 1
        if n - start >= max(n / 2, 2 * p):
            return p
    return None


def repetition(tokens: list[int], n: int = 4) -> float:
    """The share of a completion's n-grams that it wrote before: 0 for text that never repeats itself, near 1 for a
    loop."""
    seen, repeated = set(), 0
    for i in range(n, len(tokens) + 1):
        gram = tuple(tokens[i - n : i])
        repeated += gram in seen
        seen.add(gram)
    return repeated / max(1, len(tokens) - n + 1)


def least_repetitive_half(completions: list[list[int]]) -> list[int]:
    """The indices of the half of the completions (at least one) that repeat themselves least."""
    order = sorted(range(len(completions)), key=lambda i: repetition(completions[i]))
    return sorted(order[: max(1, len(order) // 2)])


def loop_share(completions: list[list[int]]) -> tuple[int, int]:
    """How many completions end in a loop (`loop_period`), of how many."""
    return sum(loop_period(tokens) is not None for tokens in completions), len(completions)


def loops_line(completions: list[list[int]], summary: dict, method: str = "staged") -> str:
    """One line for beside a headline: how many of the baseline's completions end in a loop, and `method`'s median
    speedup on the least repetitive half of the prompts against all of them."""
    loops, n = loop_share(completions)
    line = f"Loops: {loops} of {n} of the baseline's completions end in a loop of at most {LONGEST_LOOP} tokens"
    speedup = summary.get(method, {}).get("speedup")
    if speedup is None:
        return line + "."
    return (line + f"; {method}'s median speedup on the least repetitive half of the prompts "
            f"{speedup['least_repetitive_half']:.2f}x ({speedup['median']:.2f}x on all).")


def looping(completions: list[list[int]], share: float = 0.2) -> str | None:
    """A warning when at least `share` of the oracle's greedy completions end in a loop: drafters that copy the
    loop then accept runs that an oracle writing code would not give. One loop among 50 prompts moves the table
    little; nine of ten (the quick preset's oracle) make it."""
    loops, n = loop_share(completions)
    if not loops or loops < share * n:
        return None
    return (f"Note: {loops} of {n} of the oracle's completions end in a loop of at most {LONGEST_LOOP} tokens (small "
            f"and untrained oracles loop); drafters that copy a loop accept long runs on it, so an oracle that loops less "
            f"gives fewer tokens per call than this table; the column 'least repetitive half' leaves the loops out.")


# Prompts this many times longer (or shorter) on average than a plan's calibration prompts: reading them, which every
# method pays alike, takes a share of the time the forecast did not price
LENGTH_RATIO = 1.5


def calibration_length_note(plan: dict | None, prompt_tokens: float) -> str | None:
    """A note where the prompts (`prompt_tokens` on average) are much longer or shorter than those the plan was
    calibrated on: its forecast priced reading prompts of their length, so it holds less well on these."""
    calibrated = plan["calibration"].get("prompt_tokens") if plan is not None else None
    if not calibrated or 1 / LENGTH_RATIO < prompt_tokens / calibrated < LENGTH_RATIO:
        return None
    return (f"Note: these prompts average {prompt_tokens:.0f} tokens and the plan's calibration prompts {calibrated:.0f}. "
            f"Reading a prompt costs every method alike, so the speedup on {'longer' if prompt_tokens > calibrated else 'shorter'} "
            f"prompts is {'lower' if prompt_tokens > calibrated else 'higher'} than the forecast, which priced the "
            f"calibration's; python -m decode.plan --prompts FILE calibrates on prompts like these.")


def interval_text(interval: list[float] | None, bracketed: bool = True) -> str:
    """A forecast's 90% interval as printed beside its speedup: " (1.20-1.40x)" (bracketed) or "1.20-1.40x"; "" for none."""
    if not interval:
        return ""
    text = "{:.2f}-{:.2f}x".format(*interval)
    return f" ({text})" if bracketed else text


def forecast_rows(summary: dict) -> list[dict]:
    """Each planned method's forecast beside its measurement: tokens per oracle call, and the speedup in tokens/s
    over the baseline's, with the plan's 90% interval where it has one."""
    base = summary["baseline"]["tokens_per_second"]
    return [{"method": name, "tokens_per_call": (s["predicted"]["tokens_per_call"], s["tokens_per_oracle_call"]),
             "speedup": (s["predicted"]["speedup"], s["tokens_per_second"] / base),
             "interval": s["predicted"].get("speedup_interval")}
            for name, s in summary.items() if "predicted" in s]
