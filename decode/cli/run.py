"""Decode prompts with the oracle alone or with speculative decoding; same output either way.

    python -m decode.run --run RUN --method speculative --limit 10
    python -m decode.run --oracle RUN/oracle --draft RUN/draft --method baseline --prompt "def add(a, b):"
    python -m decode.run --run RUN --method speculative --temperature 1 --top-k 50 --out out.jsonl
"""
import json

from decode.api import SpeculativeDecoder, drain
from decode.atomic import FILE, atomic_output, check_output
from decode.cli.flags import announce_plan
from decode.cli.settings import Settings, encode_prompts, parse_settings
from decode.errors import exits_on_input_error
from decode.generation import Request

PROG = "python -m decode.run"


def parse(argv=None) -> Settings:
    return parse_settings(argv, PROG, __doc__.split("\n\n")[0])


def summary_row(method: str, records: list[dict]) -> str:
    new = sum(r["new_tokens"] for r in records)
    seconds = sum(r["seconds"] for r in records)
    calls = sum(r["oracle_calls"] for r in records)
    return f"{method:<12} {len(records):>7} {new:>10} {seconds:>9.2f} {new / seconds:>9.1f} {new / calls:>16.2f}"


@exits_on_input_error
def main(argv=None) -> list[dict]:
    settings = parse(argv)
    if settings.out:
        check_output(settings.out, FILE, settings.overwrite, "--out", settings.reads())
    dec = SpeculativeDecoder(settings.options)
    method = dec.options.method
    announce_plan(dec.options)
    records = []
    for i, (record, prompt) in enumerate(encode_prompts(settings, [dec])):
        request = Request(settings.max_new_tokens, settings.sampling, settings.seed + i)
        pieces = dec.decode(prompt, request, pieces=settings.stream)
        if settings.stream:
            print(record["prompt"], end="", flush=True)
        result = drain(pieces, lambda piece: print(piece, end="", flush=True))
        if settings.stream:
            print("\n")
        records.append({
            "task_id": record["task_id"], "method": method, "completion": result.text,
            "healed": result.healed, "token_ids": result.token_ids, "new_tokens": len(result.token_ids),
            "seconds": result.seconds, "oracle_calls": result.oracle_calls, "draft_calls": result.draft_calls,
            "tokens_per_oracle_call": result.tokens_per_oracle_call,
        })
    if settings.out:
        with atomic_output(settings.out, FILE, settings.overwrite) as tmp:
            tmp.write_text("".join(json.dumps(r) + "\n" for r in records))
    if settings.prompt is not None and not settings.stream:
        print(settings.prompt + records[0]["completion"])
        print()
    print(f"{'method':<12} {'prompts':>7} {'new tokens':>10} {'seconds':>9} {'tokens/s':>9} {'tokens/oracle call':>16}")
    print(summary_row(method, records))
    return records


if __name__ == "__main__":
    main()
