"""Where a decoding step's time goes: the oracle's forward, the draft's forwards, building the
trigram's trees, the rest of tree building, verification and the rest of the loop. Each part is
given in milliseconds per oracle call, as a share of the step, and as a fraction of one q=1 oracle
forward measured in the same run (before each prompt; the median): the cost a speculative step has to beat.

    python -m decode.profile_step --run RUN --method staged --limit 10 --dtype bfloat16

Every other flag is decode.run's. The parts are timed by wrapping the models' forward, the
trigram's tree builder (it runs once per new context; trees are remembered), the drafter's propose
and the verifier; tree building is propose minus the forwards and trigram trees inside it.
"""
import statistics
import time

from data.errors import exits_on_input_error
from decode import costs, generate, run
from decode.api import SpeculativeDecoder

BOUNDS = {"around the forwards": 0.10, "draft forwards": 0.30}  # of an oracle q=1 forward, the step's budget


@exits_on_input_error
def main(argv=None) -> dict[str, float]:
    settings = run.parse(argv, "python -m decode.profile_step", __doc__.split("\n\n")[0])
    dec = SpeculativeDecoder(settings.options)
    dec.use(settings.sampling)
    decoder, prompts = dec.decoder, run.encode_prompts(settings, [dec])
    watch = costs.Stopwatch(decoder.oracle.device)
    watch.wrap(decoder.oracle, "forward", "oracle forward")
    if decoder.draft is not None:
        watch.wrap(decoder.draft, "forward", "draft forward")
    if decoder.drafter is not None:
        watch.wrap(decoder.drafter, "propose", "propose")
        if hasattr(decoder.drafter, "trigram"):
            watch.wrap(decoder.drafter.trigram, "build", "trigram trees")
    for rule in ("sample_match", "multi_draft_rejection"):  # the loop looks them up in decode.generate
        watch.wrap(generate, rule, "verification")
    decoder(prompts[0][1], 8, settings.seed)  # warm-up
    watch.seconds.clear()
    total = steps = tokens = 0
    one_token = []  # measured before each prompt: on a shared machine the speed drifts within a run
    for i, (_, prompt) in enumerate(prompts):
        with watch.paused():
            one_token.append(costs.forward_costs(decoder.oracle, repeats=10, counts=(1,))[1])
        start = time.perf_counter()
        out = decoder(prompt, settings.max_new_tokens, settings.seed + i)
        total += time.perf_counter() - start
        steps += out.oracle_calls
        tokens += len(out.tokens)
    parts = dict(watch.seconds)
    if "propose" in parts:  # every draft forward and trigram tree is built while proposing
        parts["tree building"] = parts.pop("propose") - parts.get("draft forward", 0.0) - parts.get("trigram trees", 0.0)
    parts["rest of the loop"] = total - sum(parts.values())
    ms = {label: 1e3 * seconds / steps for label, seconds in parts.items()}
    step_ms, one_token_ms = 1e3 * total / steps, statistics.median(one_token)
    print(f"{settings.options.method}: {len(prompts)} prompts, {tokens} tokens, {steps} oracle calls "
          f"({tokens / steps:.2f} tokens per call), {step_ms:.2f} ms per call; one q=1 oracle forward: "
          f"{one_token_ms:.2f} ms (median over the prompts, {min(one_token):.2f}-{max(one_token):.2f})")
    print(f"  {'part':<20} {'ms/call':>8} {'of step':>8} {'x q=1':>7}")
    for label, value in ms.items():
        print(f"  {label:<20} {value:8.3f} {100 * value / step_ms:7.1f}% {value / one_token_ms:7.2f}")
    groups = {"around the forwards": sum(v for k, v in ms.items() if not k.endswith("forward")),
              "draft forwards": ms.get("draft forward", 0.0)}
    for label, value in groups.items():
        print(f"  {label:<20} {value:8.3f} {'':8} {value / one_token_ms:7.2f}  (budget {BOUNDS[label]:.2f})")
    return ms


if __name__ == "__main__":
    main()
