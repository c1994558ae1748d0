"""Decode prompts with the oracle alone or with speculative decoding; same output either way.

    python -m decode.run --run RUN --method speculative --limit 10
    python -m decode.run --oracle RUN/oracle --draft RUN/draft --method baseline --prompt "def add(a, b):"
    python -m decode.run --run RUN --method speculative --temperature 1 --top-k 50 --out out.jsonl
"""
import argparse
import json
from dataclasses import dataclass
from pathlib import Path

from data.atomic import FILE, atomic_output, check_output
from data.cli import HelpFormatter
from data.errors import InputError, exits_on_input_error
from data.prompts import load_prompts
from decode.api import SpeculativeDecoder, drain
from decode.cli.flags import DecoderFlags, add_decoder_flags, announce_plan, decoder_flags
from decode.generation import Request
from decode.healing import Prompt
from decode.options import DecoderOptions, sampling_of
from decode.sampling import Sampling


@dataclass
class Settings:
    """decode.run's flags, parsed and checked: what the other tools share with it."""

    flags: DecoderFlags
    sampling: Sampling
    prompt: str | None
    prompts: str | None
    limit: int | None
    max_new_tokens: int
    seed: int
    out: Path | None
    overwrite: bool
    stream: bool
    run: Path | None = None

    def reads(self) -> dict:
        """What the tools read, which none of their outputs may write over: the models (the oracle's directory holds
        the tokenizer), the trigram, the plan and the prompts file."""
        base = self.flags.base
        prompts = Path(self.prompts) if self.prompts not in (None, "humaneval") else None
        return {"oracle": base.oracle, "draft": base.draft, "trigram": base.ngram, "plan": self.flags.plan,
                "prompts": prompts}

    @property
    def options(self) -> DecoderOptions:
        """The options of --method, with its plan's policy."""
        return self.flags.options()


def parse(argv=None, prog: str = "python -m decode.run", description: str = __doc__.split("\n\n")[0],
          dtype_from_plan: bool = True) -> Settings:
    """decode.run's flags as Settings; the tools built on them pass their own name and summary, and the planner
    `dtype_from_plan=False` (decoder_flags)."""
    p = argparse.ArgumentParser(prog=prog, description=description, formatter_class=HelpFormatter)
    add_decoder_flags(p)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="one prompt text")
    src.add_argument("--prompts", help="'humaneval' or a .jsonl[.gz] file of {task_id, prompt} (default: RUN/prompts.jsonl)")
    p.add_argument("--limit", type=int, help="the first N prompts")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate per prompt")
    p.add_argument("--temperature", type=float, default=0.0, help="0 means greedy")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0: all)")
    p.add_argument("--top-p", type=float, default=1.0, help="keep the smallest set with this much probability")
    p.add_argument("--seed", type=int, default=0, help="the first prompt's sampling seed; prompt i takes seed + i")
    p.add_argument("--out", type=Path, help="write one JSON object per prompt here (.jsonl)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    p.add_argument("--stream", action="store_true", help="print each completion as its tokens are accepted")
    args = p.parse_args(argv)
    if args.run is not None and args.prompt is None and args.prompts is None:
        args.prompts = str(args.run / "prompts.jsonl")
    if args.prompt is None and args.prompts is None:
        p.error("pass --prompt TEXT or --prompts humaneval|FILE (or --run RUN)")
    if args.limit is not None and args.limit < 1:
        p.error(f"--limit must be at least 1 (got {args.limit}); leave it out for every prompt")
    try:
        sampling = sampling_of(args.temperature, args.top_k, args.top_p)
    except InputError as err:
        p.error(str(err))
    flags = decoder_flags(p, args, sampling, dtype_from_plan)
    return Settings(flags, sampling, args.prompt, args.prompts, args.limit, args.max_new_tokens, args.seed, args.out,
                    args.overwrite, args.stream, args.run)


def encode_prompts(settings: Settings, decoders: list[SpeculativeDecoder], records: list[dict] | None = None
                   ) -> list[tuple[dict, Prompt]]:
    """The prompts (`records`, or the settings'), checked to fit every decoder's context with its
    lookahead, healed as the first decodes them."""
    if records is None and settings.prompt is not None:
        records = [{"task_id": "prompt", "prompt": settings.prompt}]
    elif records is None:
        records = load_prompts(settings.prompts, settings.limit)
    first = min(decoders, key=lambda d: d.decoder.context())
    lookahead = max(d.decoder.lookahead() for d in decoders)
    return [(record, first.encode(first.token_ids(record["prompt"], f"prompt {record['task_id']!r}"),
                                  record["task_id"], settings.max_new_tokens, lookahead)) for record in records]


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
