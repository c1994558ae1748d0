"""Where a decoding step's time goes: the oracle's forward, the draft's forwards, trigram lookups,
tree building, verification and the rest of the loop, in milliseconds per oracle call.

    python -m decode.profile_step --run RUN --method staged --limit 5 --dtype bfloat16

Every flag is decode.run's. The parts are timed by wrapping the models' forward, the trigram's
lookup, the drafter's propose and the verifier; tree building is propose minus the forwards and
lookups inside it.
"""
import time
from collections import defaultdict

from data.errors import exits_on_input_error
from decode import generate, run
from decode.api import SpeculativeDecoder


class Stopwatch:
    def __init__(self):
        self.seconds = defaultdict(float)

    def wrap(self, owner, name: str, label: str) -> None:
        """Replace owner.name (a method or a module function) with a timed version."""
        inner = getattr(owner, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds[label] += time.perf_counter() - start

        setattr(owner, name, timed)


@exits_on_input_error
def main(argv=None) -> dict[str, float]:
    settings = run.parse(argv)
    dec = SpeculativeDecoder(settings.options)
    dec.use(settings.sampling)
    decoder, prompts = dec.decoder, run.encode_prompts(settings, [dec])
    watch = Stopwatch()
    watch.wrap(decoder.oracle, "forward", "oracle forward")
    if decoder.draft is not None:
        watch.wrap(decoder.draft, "forward", "draft forward")
    if decoder.drafter is not None:
        watch.wrap(decoder.drafter, "propose", "propose")
        if hasattr(decoder.drafter, "table"):
            watch.wrap(decoder.drafter.table, "successors", "trigram lookups")
    for rule in ("sample_match", "multi_draft_rejection"):  # the loop looks them up in decode.generate
        watch.wrap(generate, rule, "verification")
    decoder(prompts[0][1], 8, settings.seed)  # warm-up
    watch.seconds.clear()
    total = steps = tokens = 0
    for i, (_, prompt) in enumerate(prompts):
        start = time.perf_counter()
        out = decoder(prompt, settings.max_new_tokens, settings.seed + i)
        total += time.perf_counter() - start
        steps += out.oracle_calls
        tokens += len(out.tokens)
    parts = dict(watch.seconds)
    if "propose" in parts:  # every draft forward and lookup happens while proposing
        parts["tree building"] = parts.pop("propose") - parts.get("draft forward", 0.0) - parts.get("trigram lookups", 0.0)
    parts["rest of the loop"] = total - sum(parts.values())
    print(f"{settings.options.method}: {len(prompts)} prompts, {tokens} tokens, {steps} oracle calls "
          f"({tokens / steps:.2f} tokens per call), {1e3 * total / steps:.2f} ms per call")
    for label, seconds in parts.items():
        print(f"  {label:<18} {1e3 * seconds / steps:8.2f} ms  {100 * seconds / total:5.1f}%")
    return {label: 1e3 * seconds / steps for label, seconds in parts.items()}


if __name__ == "__main__":
    main()
