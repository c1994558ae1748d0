"""Where a decoding step's time goes: the oracle's forward, the draft's forwards, building the
trigram's trees, the rest of tree building, verification and the rest of the loop. Each part is
given in milliseconds per step, as a share of the step, and as a fraction of one q=1 oracle
forward measured in the same run (before each prompt; the median): the cost a speculative step has to beat.
Reading the prompt (each model's forward at an empty cache: the oracle's prompt, the draft's prompt with
the first tree) happens once per prompt and is reported apart, per prompt. The prompts are decoded once untimed
first: in bfloat16 on a CPU, oneDNN builds a kernel the first time a matrix is multiplied with a new number of
rows, a cost paid once per process and tree size, not per step; the first pass's extra time is
reported apart. The trigram's remembered trees are forgotten after it, so new contexts cost what they do.

    python -m decode.profile_step --run RUN --method staged --limit 10 --dtype bfloat16
    python -m decode.profile_step --run RUN --concurrency 1,4 --limit 32

With --concurrency, the prompts are decoded as decode.load's clients send them, that many at once, each level
through one batch as decode.serve decodes (every request's piece of the oracle forward in one call, every chain of
the draft in one call), after one untimed request: each level's steps, requests in flight and tokens a step, and the
parts of a step that reads no prompt (decode.benchmarking.batch_steps).

Every other flag is decode.run's. Hooks around the loop's parts (decode.timing.steps) time the oracle's forwards, the
drafter's proposals and the verifications; the draft's forward (a chain's forwards made in one C++ call, with the
tokens each chooses, as one) and the work a drafter names as its parts (the trigram's tree builder, which runs once
per new context: trees are remembered) are timed by wrapping them; tree building is the proposals less the forwards
and trigram trees inside them.
"""
import argparse
import datetime
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from decode.api import SpeculativeDecoder
from decode.atomic import FILE, check_output, write_json
from decode.benchmarking import batch_steps, load
from decode.cli.flags import levels
from decode.cli.help import HelpFormatter
from decode.cli.settings import Settings, encode_prompts, parse_settings
from decode.devices import machine_name
from decode.errors import exits_on_input_error
from decode.provenance import command_line, provenance
from decode.timing import forwards
from decode.timing.steps import Timer

PROG = "python -m decode.profile_step"

BOUNDS = {"around the forwards": 0.10, "draft forwards": 0.30}  # of an oracle q=1 forward, the step's budget


@dataclass
class Pass:
    """Every prompt decoded once: the seconds spent decoding, the oracle's calls and the tokens."""

    seconds: float = 0.0
    calls: int = 0
    tokens: int = 0


def parse(argv) -> tuple[argparse.Namespace, Settings]:
    """profile_step's own flags, checked, and decode.run's, parsed."""
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter,
                                epilog="Every other flag is decode.run's (--run, --method, --prompts, --limit, "
                                       "--max-new-tokens, --temperature, --dtype, ...).")
    p.add_argument("--concurrency", type=levels, metavar="N[,N...]",
                   help="profile the steps of N requests decoding at once, as decode.serve and decode.load decode them "
                        "(default: one prompt at a time, alone)")
    p.add_argument("--out", type=Path, help="with --concurrency: write each level's figures here as JSON (python -m "
                                            "decode.report FILE --markdown shows them)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    known, rest = p.parse_known_args(argv)
    if known.out and not known.concurrency:
        p.error("--out writes the profile of --concurrency's levels: add --concurrency (e.g. 1,4)")
    settings = parse_settings(rest, PROG, __doc__.split("\n\n")[0], records=False)
    if known.out:
        check_output(known.out, FILE, known.overwrite, "--out", settings.reads())
    return known, settings


@exits_on_input_error
def main(argv=None) -> dict:
    known, settings = parse(argv)
    dec = SpeculativeDecoder(settings.options)
    if known.concurrency:
        prompt_ids = [dec.token_ids(record["prompt"]) for record, _ in encode_prompts(settings, [dec])]
        levels = profile_batches(dec, prompt_ids, settings, known.concurrency)
        if known.out:
            write_json(known.out, {"settings": batches_settings(dec, settings, argv, len(prompt_ids)),
                                   "batch_steps": levels}, known.overwrite)
            print(f"wrote {known.out}")
        return levels
    decoder, prompts = dec.decoder, [prompt for _, prompt in encode_prompts(settings, [dec])]
    timer = Timer(decoder.oracle.runtime.synchronize)
    if (draft := decoder.draft) is not None:  # a chain's forwards made in one call count as the draft's forwards
        for name in ("forward", "chain"):
            timer.wrap(draft, name, lambda: f"draft {'prompt' if draft.length == 0 else 'forward'}")
    if (trigram := getattr(decoder.drafter, "trigram", None)) is not None:  # drafting.base: a trigram's trees
        timer.wrap(trigram, "build", "trigram trees")
    with timer.paused():
        first = timed_pass(decoder, prompts, settings, timer)
    if decoder.drafter is not None:  # its remembered trigram trees: new contexts then cost what they do
        decoder.drafter.forget()
    timer.clear()
    one_token = []  # measured before each prompt: on a shared machine the speed drifts within a run

    def measure_one_token() -> None:
        with timer.paused():
            one_token.append(forwards.forward_costs(decoder.oracle, repeats=10, counts=(1,))[1])

    timed = timed_pass(decoder, prompts, settings, timer, measure_one_token)
    ms = step_parts(timer, timed)
    print_profile(decoder, len(prompts), timer, timed, first, ms, one_token)
    return ms


def steps_of(timer: Timer, timed: Pass) -> int:
    """The oracle's calls that were steps: each prompt's first reads it."""
    return timed.calls - timer.calls["oracle prompt"]


def step_parts(timer: Timer, timed: Pass) -> dict[str, float]:
    """Milliseconds per step of each part: tree building is the proposals less the draft's forwards and the trigram's
    trees inside them; reading the prompts is apart."""
    parts = dict(timer.seconds)
    reading = [parts.pop(f"{name} prompt", 0.0) for name in ("oracle", "draft")]
    if "propose" in parts:
        parts["tree building"] = parts.pop("propose") - parts.get("draft forward", 0.0) - reading[1] - parts.get("trigram trees", 0.0)
    parts["rest of the loop"] = timed.seconds - sum(parts.values()) - sum(reading)
    return {label: 1e3 * seconds / steps_of(timer, timed) for label, seconds in parts.items()}


def print_profile(decoder, prompts: int, timer: Timer, timed: Pass, first: Pass, ms: dict[str, float],
                  one_token: list[float]) -> None:
    step_ms, one_token_ms = sum(ms.values()), statistics.median(one_token)
    reading = {name: timer.seconds.get(f"{name} prompt", 0.0) for name in ("oracle", "draft")}
    loops = decoder.oracle.runtime.loops()
    loops += " (STAGED_SPECULATIVE_NATIVE=0 or no compiler)" if loops == "Python" else ""
    print(f"{decoder.options.method}: {prompts} prompts, {timed.tokens} tokens, {timed.calls} oracle calls "
          f"({timed.tokens / timed.calls:.2f} tokens per call), {steps_of(timer, timed)} of them steps of {step_ms:.2f} "
          f"ms; one q=1 oracle forward: {one_token_ms:.2f} ms (median over the prompts, {min(one_token):.2f}-"
          f"{max(one_token):.2f}); step loops in {loops}")
    draft = f", draft {1e3 * reading['draft'] / prompts:.2f} ms (with the first tree)" if decoder.draft is not None else ""
    built = "kernels built per new shape" + (", trigram trees" if "trigram trees" in ms else "")
    print(f"  the untimed first pass took {first.seconds - timed.seconds:.2f} s more than this one ({built}; "
          f"{first.seconds:.2f} s against {timed.seconds:.2f})")
    print(f"  reading a prompt, apart from the steps: oracle {1e3 * reading['oracle'] / prompts:.2f} ms{draft}; "
          f"{100 * sum(reading.values()) / timed.seconds:.1f}% of the time")
    print(f"  {'part':<20} {'ms/step':>8} {'of step':>8} {'x q=1':>7}")
    for label, value in ms.items():
        print(f"  {label:<20} {value:8.3f} {100 * value / step_ms:7.1f}% {value / one_token_ms:7.2f}")
    groups = {"around the forwards": sum(v for k, v in ms.items() if not k.endswith("forward")),
              "draft forwards": ms.get("draft forward", 0.0)}
    for label, value in groups.items():
        ratio = value / one_token_ms  # three places: near a budget, two would round across it
        print(f"  {label:<20} {value:8.3f} {'':8} {ratio:7.3f}  (budget {BOUNDS[label]:.2f}: "
              f"{'within' if ratio <= BOUNDS[label] else 'over'})")


def profile_batches(dec: SpeculativeDecoder, prompts: list[list[int]], settings: Settings, counts: tuple[int, ...]
                    ) -> dict[int, dict]:
    """Each level's batch_steps.summary, printed a column a level."""
    dec.batch.reserve(dec.decoder, counts[-1])  # every level's caches, made before any timing
    dec.generate(prompts[0], max_new_tokens=8)  # untimed: what a first call builds
    levels = {}
    for clients in counts:
        with batch_steps.timed_steps(dec.batch, dec.decoder.oracle.runtime.synchronize) as steps:
            served, _ = load.ours(dec, prompts, clients, settings.max_new_tokens, settings.sampling_arguments())
        levels[clients] = batch_steps.summary(steps, sum(s.tokens for s in served))
    print_batches(dec, len(prompts), levels)
    return levels


def batches_settings(dec: SpeculativeDecoder, settings: Settings, argv, prompts: int) -> dict:
    """What a --concurrency profile ran, where and when, for its JSON."""
    return {"command": command_line(PROG, argv), "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
            "machine": machine_name(dec.decoder.oracle.device), "threads": torch.get_num_threads(),
            "method": dec.decoder.options.method, "prompts": prompts,
            "max_new_tokens": settings.max_new_tokens, "sampling": settings.sampling.describe(),
            "dtype": settings.options.dtype, **provenance()}


def print_batches(dec: SpeculativeDecoder, prompts: int, levels: dict[int, dict]) -> None:
    print(f"{dec.decoder.options.method}: {prompts} prompts at each level, every request in flight scored in one oracle "
          f"forward a step")
    for label, values in batch_steps.table(levels):
        print(f"  {label:<36}" + "".join(f"{value:>9}" for value in values))


def timed_pass(decoder, prompts, settings, timer: Timer, before_each=None) -> Pass:
    """Every prompt decoded once, its parts timed. `before_each` runs, untimed, before each prompt."""
    timed = Pass()
    hooks = timer.hooks()
    for i, prompt in enumerate(prompts):
        if before_each is not None:
            before_each()
        start = time.perf_counter()
        out = decoder(prompt, settings.max_new_tokens, settings.seed + i, settings.sampling, hooks)
        timed.seconds += time.perf_counter() - start
        timed.calls += out.oracle_calls
        timed.tokens += len(out.tokens)
    return timed


if __name__ == "__main__":
    main()
