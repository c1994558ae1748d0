"""Decode prompts with the oracle alone or with speculative decoding; same output either way.

    python -m decode.run --run RUN --method speculative --limit 10
    python -m decode.run --oracle RUN/oracle --draft RUN/draft --method baseline --prompt "def add(a, b):"
    python -m decode.run --run RUN --method speculative --temperature 1 --top-k 50 --output out.jsonl
"""
import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from data.atomic import atomic_output
from data.errors import InputError, exits_on_input_error
from data.prompts import load_prompts
from data.tokenizer import load_tokenizer
from decode import generate
from decode.cached_lm import CachedLM
from decode.engine import GPT2Engine, is_lean_compatible, read_config
from decode.hf_backend import HFEngine
from decode.sampling import Sampling

METHODS = {"baseline": generate.baseline, "speculative": generate.speculative}
NEEDS_DRAFT = {"speculative"}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m decode.run", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--run", type=Path, help="run directory: defaults --oracle, --draft, --ngram and --prompts to its parts")
    p.add_argument("--oracle", type=Path, help="the oracle's directory (save_pretrained)")
    p.add_argument("--draft", type=Path, help="the draft's directory (for speculative methods)")
    p.add_argument("--ngram", type=Path, help="the Katz trigram's directory (for n-gram drafting)")
    p.add_argument("--method", choices=sorted(METHODS), default="speculative")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="one prompt text")
    src.add_argument("--prompts", help="'humaneval' or a .jsonl[.gz] file of {task_id, prompt} (default: RUN/prompts.jsonl)")
    p.add_argument("--limit", type=int, help="the first N prompts")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 means greedy")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0: all)")
    p.add_argument("--top-p", type=float, default=1.0, help="keep the smallest set with this much probability")
    p.add_argument("--k", type=int, default=4, help="speculative: tokens the draft proposes per oracle call")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--backend", choices=["auto", "lean", "hf"], default="auto",
                   help="lean: our GPT-2 engine; hf: any transformers causal LM; auto: lean where it applies")
    p.add_argument("--output", type=Path, help="write one JSON object per prompt here")
    args = p.parse_args(argv)
    if args.run is not None:
        args.oracle = args.oracle or args.run / "oracle"
        args.draft = args.draft or args.run / "draft"
        args.ngram = args.ngram or args.run / "ngram"
        if args.prompt is None and args.prompts is None:
            args.prompts = str(args.run / "prompts.jsonl")
    if args.oracle is None:
        p.error("pass --oracle DIR (or --run RUN)")
    if args.prompt is None and args.prompts is None:
        p.error("pass --prompt TEXT or --prompts humaneval|FILE (or --run RUN)")
    if args.temperature < 0 or not 0 < args.top_p <= 1 or args.top_k < 0 or args.k < 0 or args.max_new_tokens < 1:
        p.error("need --temperature >= 0, 0 < --top-p <= 1, --top-k >= 0, --k >= 0 and --max-new-tokens >= 1")
    return args


def load_model(directory: Path, backend: str, dtype: str, device: str) -> CachedLM:
    config = read_config(directory)
    if backend == "lean" or (backend == "auto" and is_lean_compatible(config)):
        return GPT2Engine.load(directory, dtype, device)
    return HFEngine.load(directory, dtype, device)


def check_same_vocabulary(oracle_dir: Path, other_dir: Path, other: str) -> None:
    a, b = load_tokenizer(oracle_dir), load_tokenizer(other_dir)
    if a.get_vocab() != b.get_vocab():
        raise InputError(f"the oracle ({oracle_dir}) and the {other} ({other_dir}) use different tokenizers; "
                         f"train the {other} with the oracle's tokenizer")


@dataclass
class Decoder:
    """Everything a method needs to decode one prompt."""

    method: str
    oracle: CachedLM
    draft: CachedLM | None
    sampling: Sampling
    k: int
    eos_id: int

    def __call__(self, prompt_ids: torch.Tensor, max_new_tokens: int, seed: int) -> generate.Generation:
        generator = torch.Generator().manual_seed(seed)
        return METHODS[self.method](self.oracle, prompt_ids, max_new_tokens, self.sampling, self.eos_id, generator,
                                    draft=self.draft, k=self.k)

    def context(self) -> int:
        return min(m.max_length for m in (self.oracle, self.draft) if m is not None)


def build_decoder(args) -> tuple[Decoder, object]:
    if not Path(args.oracle).is_dir():
        raise InputError(f"oracle directory {args.oracle} does not exist; train one with train/finetune_oracle.py")
    oracle = load_model(args.oracle, args.backend, args.dtype, args.device)
    tokenizer = load_tokenizer(args.oracle)
    draft = None
    if args.method in NEEDS_DRAFT:
        if args.draft is None or not Path(args.draft).is_dir():
            raise InputError(f"--method {args.method} needs a draft model; pass --draft DIR (got {args.draft})")
        check_same_vocabulary(args.oracle, args.draft, "draft")
        draft = load_model(args.draft, args.backend, args.dtype, args.device)
        if draft.vocab_size != oracle.vocab_size:
            raise InputError(f"the oracle has {oracle.vocab_size} output tokens and the draft {draft.vocab_size}; they must match")
    sampling = Sampling(args.temperature, args.top_k, args.top_p)
    return Decoder(args.method, oracle, draft, sampling, args.k, tokenizer.eos_token_id), tokenizer


def encode_prompts(args, tokenizer, context: int) -> list[tuple[dict, torch.Tensor]]:
    records = [{"task_id": "prompt", "prompt": args.prompt}] if args.prompt is not None else load_prompts(args.prompts, args.limit)
    encoded = []
    for record in records:
        ids = tokenizer(record["prompt"], add_special_tokens=False).input_ids
        if not ids:
            raise InputError(f"prompt {record['task_id']!r} is empty; give some text to continue")
        room = context - len(ids) - args.k - 1
        if room < 1:
            raise InputError(f"prompt {record['task_id']!r} has {len(ids)} tokens; the models' context of {context} leaves no room to generate")
        if args.max_new_tokens > room:
            raise InputError(f"--max-new-tokens {args.max_new_tokens} does not fit the context of {context} after "
                             f"prompt {record['task_id']!r} ({len(ids)} tokens); use at most {room}")
        encoded.append((record, torch.tensor(ids, device=args.device)))
    return encoded


def summary_row(method: str, records: list[dict]) -> str:
    new = sum(r["new_tokens"] for r in records)
    seconds = sum(r["seconds"] for r in records)
    calls = sum(r["oracle_calls"] for r in records)
    return f"{method:<12} {len(records):>7} {new:>10} {seconds:>9.2f} {new / seconds:>9.1f} {new / calls:>16.2f}"


@exits_on_input_error
def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    decoder, tokenizer = build_decoder(args)
    prompts = encode_prompts(args, tokenizer, decoder.context())
    records = []
    for i, (record, ids) in enumerate(prompts):
        start = time.perf_counter()
        result = decoder(ids, args.max_new_tokens, args.seed + i)
        seconds = time.perf_counter() - start
        records.append({
            "task_id": record["task_id"], "method": args.method,
            "completion": tokenizer.decode([t for t in result.tokens if t != decoder.eos_id]),
            "token_ids": result.tokens, "new_tokens": len(result.tokens), "seconds": seconds,
            "oracle_calls": result.oracle_calls, "draft_calls": result.draft_calls,
            "tokens_per_oracle_call": len(result.tokens) / result.oracle_calls,
        })
    if args.output:
        with atomic_output(args.output) as tmp:
            tmp.write_text("".join(json.dumps(r) + "\n" for r in records))
    if args.prompt is not None:
        print(args.prompt + records[0]["completion"])
        print()
    print(f"{'method':<12} {'prompts':>7} {'new tokens':>10} {'seconds':>9} {'tokens/s':>9} {'tokens/oracle call':>16}")
    print(summary_row(args.method, records))
    return records


if __name__ == "__main__":
    main()
