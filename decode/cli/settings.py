"""The settings every decoding command shares (decode.run, decode.bench, decode.plan, decode.agreement,
decode.profile_step, decode.load): decode.run's flags parsed into Settings, and the prompts they name, encoded for
the decoders."""
import argparse
from dataclasses import dataclass
from pathlib import Path

from decode.api import SpeculativeDecoder
from decode.cli.flags import add_decoder_flags, check_ranges, decoder_flags
from decode.cli.help import HelpFormatter
from decode.errors import InputError
from decode.healing import Prompt
from decode.options import DecoderOptions, sampling_of
from decode.prompts import load_prompts
from decode.resolution import Resolved
from decode.sampling import Sampling


@dataclass
class Settings:
    """decode.run's flags, parsed and checked: what every decoding command shares."""

    flags: Resolved
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
        return {"oracle": base.oracle, "draft": base.draft, "trigram": base.ngram, "plan": self.plan,
                "prompts": prompts}

    @property
    def plan(self) -> Path | None:
        """The plan this sampling setting decodes with (None: none)."""
        return self.flags.plan_for(self.sampling)[0]

    def options_of(self, method: str | None = None) -> DecoderOptions:
        """The options of `method` (default: --method's), with its plan's policy for this sampling setting."""
        return self.flags.options(self.sampling, method)

    @property
    def options(self) -> DecoderOptions:
        """The options of --method, with its plan's policy."""
        return self.options_of()

    def sampling_arguments(self) -> dict:
        """The sampling setting as SpeculativeDecoder.generate and stream_in take it (none: greedy)."""
        s = self.sampling
        return {} if s.greedy else {"do_sample": True, "temperature": s.temperature, "top_k": s.top_k, "top_p": s.top_p}


def add_result_flags(p: argparse.ArgumentParser, figures: str, plotted: str) -> None:
    """A benchmark's --out (its `figures` as JSON), --plot (of what is `plotted`) and --overwrite."""
    p.add_argument("--out", type=Path, help=f"write {figures} as JSON here")
    p.add_argument("--plot", type=Path, help=f"write {plotted} here (.png, .svg)")
    p.add_argument("--overwrite", action="store_true", help="replace existing --out and --plot files")


def parse_settings(argv, prog: str, description: str, dtype_from_plan: bool = True, records: bool = True) -> Settings:
    """decode.run's flags as Settings, for the command `prog` (its --help shows `description`); the planner passes
    `dtype_from_plan=False` (decoder_flags). Without `records` the command writes and prints no completions: no
    --out, --overwrite or --stream."""
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
    if records:
        p.add_argument("--out", type=Path, help="write one JSON object per prompt here (.jsonl)")
        p.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
        p.add_argument("--stream", action="store_true", help="print each completion as its tokens are accepted")
    p.set_defaults(**({} if records else {"out": None, "overwrite": False, "stream": False}))
    args = p.parse_args(argv)
    if args.run is not None and args.prompt is None and args.prompts is None:
        args.prompts = str(args.run / "prompts.jsonl")
    if args.prompt is None and args.prompts is None:
        p.error("pass --prompt TEXT or --prompts humaneval|FILE (or --run RUN)")
    if args.limit is not None and args.limit < 1:
        p.error(f"--limit must be at least 1 (got {args.limit}); leave it out for every prompt")
    check_ranges(p, [("--max-new-tokens", args.max_new_tokens, 1, None)])
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
    typed = records is None and settings.prompt is not None
    if typed:
        records = [{"task_id": "prompt", "prompt": settings.prompt}]
    elif records is None:
        assert settings.prompts is not None, "parse_settings asks for --prompt or --prompts"
        records = load_prompts(settings.prompts, settings.limit)
    first = min(decoders, key=lambda d: d.decoder.context())
    lookahead = max(d.decoder.lookahead() for d in decoders)
    names = ["--prompt" if typed else f"prompt {record['task_id']!r}" for record in records]
    return [(record, first.encode(first.token_ids(record["prompt"], name), name, settings.max_new_tokens, lookahead))
            for record, name in zip(records, names)]
