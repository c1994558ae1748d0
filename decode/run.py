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

from data.atomic import FILE, atomic_output, check_output
from data.errors import InputError, exits_on_input_error
from data.prompts import load_prompts
from data.tokenizer import load_tokenizer
from decode import costs, generate
from decode.cached_lm import CachedLM
from decode.drafters import LookupDrafter, NgramDrafter, StagedDrafter, TreeDrafter, fit_widths, trigram_tree_size
from decode.engine import GPT2Engine, is_lean_compatible, read_config
from decode.healing import Prompt, TokenHealer
from decode.hf_backend import HFEngine
from decode.sampling import Sampling

METHODS = ("baseline", "speculative", "tree", "staged", "ngram", "lookup")
NEEDS_DRAFT = {"speculative", "tree", "staged"}
NEEDS_NGRAM = {"staged", "ngram"}
MAX_BUDGET, MAX_DEPTH = 512, 64
DRAFT_SHARE = 0.3  # of a one-token oracle call, for the draft's forward in a device-sized staged step


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m decode.run", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--run", type=Path, help="run directory: defaults --oracle, --draft, --ngram and --prompts to its parts")
    p.add_argument("--oracle", type=Path, help="the oracle's directory (save_pretrained)")
    p.add_argument("--draft", type=Path, help="the draft's directory (for speculative methods)")
    p.add_argument("--ngram", type=Path, help="the Katz trigram's directory (for n-gram drafting)")
    p.add_argument("--method", choices=METHODS, default="staged",
                   help="baseline: the oracle alone; speculative: chain drafts of --k tokens; tree: draft-model trees; "
                        "staged: trigram (and context) -> draft -> oracle trees; ngram: trigram trees; "
                        "lookup: continuations found in the context (prompt lookup), no model")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="one prompt text")
    src.add_argument("--prompts", help="'humaneval' or a .jsonl[.gz] file of {task_id, prompt} (default: RUN/prompts.jsonl)")
    p.add_argument("--limit", type=int, help="the first N prompts")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 means greedy")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0: all)")
    p.add_argument("--top-p", type=float, default=1.0, help="keep the smallest set with this much probability")
    p.add_argument("--k", type=int, default=4, help="speculative: tokens the draft proposes per oracle call")
    p.add_argument("--budget", type=int, default=36, help="tree methods: nodes in the oracle's tree")
    p.add_argument("--depth", type=int, default=8, help="tree methods: deepest drafted level")
    p.add_argument("--widths", default="12,7,4,1,1,1", help="staged/ngram: trigram children per node at each level")
    p.add_argument("--branch", type=int, default=None,
                   help="tree: children per expanded node (default 4); staged: the draft's own top children per node "
                        "(default 1: an argmax costs a tenth of a top-k over the vocabulary and measured faster per token)")
    p.add_argument("--tree-children", choices=["top", "sampled"], default="top",
                   help="tree: the draft's top tokens (verified by sample-match) or samples from it (multi-draft rejection)")
    p.add_argument("--context-drafter", action=argparse.BooleanOptionalAction, default=True,
                   help="staged: graft onto the trigram's tree the tokens that followed earlier occurrences of the "
                        "sequence's current suffix (what the lookup method drafts); the draft ranks them with the rest")
    p.add_argument("--lookup-tokens", type=int, default=10,
                   help="lookup: tokens per continuation (staged: at most --depth)")
    p.add_argument("--lookup-branches", type=int, default=1, help="lookup, staged: continuations from different earlier occurrences")
    p.add_argument("--lookup-ngram", type=int, default=3, help="lookup, staged: longest suffix matched in the context")
    p.add_argument("--size-from-device", action="store_true",
                   help="staged: size the tree from the models' forward costs measured on this device (cached): narrow "
                        "--widths until the draft scores them in 30%% of an oracle call, and keep each step the number of "
                        "nodes (up to --budget) with the most expected tokens per second")
    p.add_argument("--token-healing", action=argparse.BooleanOptionalAction, default=True,
                   help="back off the prompt's last token and let the first new token be only one that extends its text "
                        "(a prompt ending in a bare newline otherwise starts where training never went); every method alike")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--backend", choices=["auto", "lean", "hf"], default="auto",
                   help="lean: our GPT-2 engine; hf: any transformers causal LM; auto: lean where it applies")
    p.add_argument("--output", type=Path, help="write one JSON object per prompt here")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --output file")
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
    if min(args.lookup_tokens, args.lookup_branches, args.lookup_ngram) < 1 or args.lookup_tokens > MAX_DEPTH:
        p.error(f"--lookup-tokens (1 to {MAX_DEPTH}), --lookup-branches and --lookup-ngram must be at least 1")
    if args.limit is not None and args.limit < 1:
        p.error(f"--limit must be at least 1 (got {args.limit}); leave it out for every prompt")
    try:
        check_device(args.device)
    except InputError as err:
        p.error(str(err))
    if args.branch is None:
        args.branch = 1 if args.method == "staged" else 4
    try:
        args.widths = [int(w) for w in args.widths.split(",")]
    except ValueError:
        p.error(f"--widths takes comma-separated integers, e.g. 12,7,4,1,1,1 (got {args.widths!r})")
    return args


def check_device(device: str) -> None:
    """cpu, or cuda[:N] on a machine that has it."""
    try:
        parsed = torch.device(device)
    except RuntimeError:
        parsed = None
    if parsed is None or parsed.type not in ("cpu", "cuda"):
        raise InputError(f"unknown --device {device!r}; use cpu or cuda (cuda:N for the N-th GPU)")
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            raise InputError(f"--device {device}: this machine has no CUDA device (or torch was built without CUDA); use --device cpu")
        if parsed.index is not None and parsed.index >= torch.cuda.device_count():
            raise InputError(f"--device {device}: there are only {torch.cuda.device_count()} CUDA devices")


def check_tree_shape(args, table) -> None:
    """Budget, depth and widths must describe a tree the drafters can build."""
    if not 2 <= args.budget <= MAX_BUDGET:
        raise InputError(f"--budget {args.budget} is out of range: the oracle's tree needs 2 to {MAX_BUDGET} nodes")
    if not 1 <= args.depth <= MAX_DEPTH:
        raise InputError(f"--depth {args.depth} is out of range: use 1 to {MAX_DEPTH}")
    if args.branch < 1:
        raise InputError(f"--branch {args.branch} must be at least 1")
    if args.method in NEEDS_NGRAM:
        if any(w < 1 for w in args.widths) or len(args.widths) > args.depth:
            raise InputError(f"--widths {args.widths} need a positive width per level and at most --depth {args.depth} levels")
        if max(args.widths) > table.k:
            raise InputError(f"--widths {args.widths} ask for {max(args.widths)} trigram children but {args.ngram} keeps "
                             f"only the top {table.k}; rebuild it with --top-k {max(args.widths)} or narrow the widths")
        if args.widths[0] + 1 > args.budget:
            raise InputError(f"--widths {args.widths} do not fit --budget {args.budget}: the first level alone has "
                             f"{args.widths[0]} nodes; raise the budget or narrow the first width")


def load_trigram(args, vocab_size: int, eos_id: int):
    from ngram.successors import SuccessorTable

    if args.ngram is None:
        raise InputError(f"--method {args.method} needs the Katz trigram; pass --ngram DIR (python ngram/build_katz.py)")
    table = SuccessorTable.load(Path(args.ngram) / "successors.npz")
    if table.vocab_size != vocab_size or table.eos_id != eos_id:
        raise InputError(f"the trigram in {args.ngram} was built for a vocabulary of {table.vocab_size} tokens "
                         f"(end-of-text {table.eos_id}), the oracle has {vocab_size} (end-of-text {eos_id}); rebuild it from this run")
    return table


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
    drafter: object | None
    sampling: Sampling
    k: int
    depth: int
    eos_id: int

    def __call__(self, prompt: Prompt, max_new_tokens: int, seed: int) -> generate.Generation:
        generator = torch.Generator(self.oracle.device).manual_seed(seed)  # torch samples with a generator on the tensors' device
        args = (self.oracle, prompt.ids, max_new_tokens, self.sampling, self.eos_id, generator, prompt.allowed)
        if self.method == "baseline":
            return generate.baseline(*args)
        if self.method == "speculative":
            return generate.speculative(*args, draft=self.draft, k=self.k)
        return generate.tree_speculative(*args, drafter=self.drafter)

    def context(self) -> int:
        return min(m.max_length for m in (self.oracle, self.draft) if m is not None)

    def lookahead(self) -> int:
        """Positions past the output a step may score: the drafted depth."""
        if self.method == "lookup":
            return self.drafter.length
        return {"baseline": 0, "speculative": self.k}.get(self.method, self.depth)


def size_from_device(args, oracle: CachedLM, draft: CachedLM) -> tuple[list[int], torch.Tensor]:
    """Trigram widths the draft scores within DRAFT_SHARE of an oracle call, and the oracle's cost per tree size."""
    oracle_costs, _ = costs.measured_costs(args.oracle, oracle, args.dtype)
    draft_costs, _ = costs.measured_costs(args.draft, draft, args.dtype, costs.DRAFT_NODE_COUNTS)
    widths = fit_widths(args.widths, costs.cost_curve(draft_costs, trigram_tree_size(args.widths)),
                        DRAFT_SHARE * oracle_costs[1])
    return widths, costs.cost_curve(oracle_costs, args.budget)


def build_decoder(args) -> tuple[Decoder, TokenHealer]:
    """The method's decoder, and the healer that turns prompt token ids into its prompts (its tokenizer: .tokenizer)."""
    if not Path(args.oracle).is_dir():
        raise InputError(f"oracle directory {args.oracle} does not exist; train one with train/finetune_oracle.py")
    oracle = load_model(args.oracle, args.backend, args.dtype, args.device)
    tokenizer = load_tokenizer(args.oracle)
    draft = table = drafter = None
    if args.method in NEEDS_DRAFT:
        if args.draft is None or not Path(args.draft).is_dir():
            raise InputError(f"--method {args.method} needs a draft model; pass --draft DIR (got {args.draft})")
        check_same_vocabulary(args.oracle, args.draft, "draft")
        draft = load_model(args.draft, args.backend, args.dtype, args.device)
        if draft.vocab_size != oracle.vocab_size:
            raise InputError(f"the oracle has {oracle.vocab_size} output tokens and the draft {draft.vocab_size}; they must match")
    if args.method in NEEDS_NGRAM:
        table = load_trigram(args, len(tokenizer), tokenizer.eos_token_id)
    sampling = Sampling(args.temperature, args.top_k, args.top_p)
    if args.method in ("tree", "staged", "ngram"):
        check_tree_shape(args, table)
    if args.method == "tree":
        drafter = TreeDrafter(draft, sampling, args.budget, args.depth, args.branch, sampled=args.tree_children == "sampled")
    elif args.method == "staged":
        oracle_ms = None
        if args.size_from_device:
            args.widths, oracle_ms = size_from_device(args, oracle, draft)
        context = LookupDrafter(args.lookup_tokens, args.lookup_branches, args.lookup_ngram) if args.context_drafter else None
        drafter = StagedDrafter(draft, table, sampling, args.budget, args.widths, args.branch, oracle_ms, context, args.depth)
    elif args.method == "ngram":
        drafter = NgramDrafter(table, args.budget, args.widths)
    elif args.method == "lookup":
        drafter = LookupDrafter(args.lookup_tokens, args.lookup_branches, args.lookup_ngram)
    decoder = Decoder(args.method, oracle, draft, drafter, sampling, args.k, args.depth, tokenizer.eos_token_id)
    return decoder, TokenHealer(tokenizer, oracle.vocab_size, args.token_healing)


def encode_prompts(args, healer: TokenHealer, context: int, lookahead: int) -> list[tuple[dict, Prompt]]:
    records = [{"task_id": "prompt", "prompt": args.prompt}] if args.prompt is not None else load_prompts(args.prompts, args.limit)
    encoded = []
    for record in records:
        ids = healer.tokenizer(record["prompt"], add_special_tokens=False).input_ids
        if not ids:
            raise InputError(f"prompt {record['task_id']!r} is empty; give some text to continue")
        room = context - len(ids) - lookahead - 1
        if room < 1:
            raise InputError(f"prompt {record['task_id']!r} has {len(ids)} tokens; the models' context of {context} leaves no room to generate")
        if args.max_new_tokens > room:
            raise InputError(f"--max-new-tokens {args.max_new_tokens} does not fit the context of {context} after "
                             f"prompt {record['task_id']!r} ({len(ids)} tokens); use at most {room}")
        encoded.append((record, healer(ids, args.device)))
    return encoded


def summary_row(method: str, records: list[dict]) -> str:
    new = sum(r["new_tokens"] for r in records)
    seconds = sum(r["seconds"] for r in records)
    calls = sum(r["oracle_calls"] for r in records)
    return f"{method:<12} {len(records):>7} {new:>10} {seconds:>9.2f} {new / seconds:>9.1f} {new / calls:>16.2f}"


@exits_on_input_error
def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    if args.output:
        check_output(args.output, FILE, args.overwrite, "--output")
    decoder, healer = build_decoder(args)
    prompts = encode_prompts(args, healer, decoder.context(), decoder.lookahead())
    records = []
    for i, (record, prompt) in enumerate(prompts):
        start = time.perf_counter()
        result = decoder(prompt, args.max_new_tokens, args.seed + i)
        seconds = time.perf_counter() - start
        records.append({
            "task_id": record["task_id"], "method": args.method,
            "completion": prompt.completion(healer.tokenizer, result.tokens, decoder.eos_id), "healed": prompt.tail,
            "token_ids": result.tokens, "new_tokens": len(result.tokens), "seconds": seconds,
            "oracle_calls": result.oracle_calls, "draft_calls": result.draft_calls,
            "tokens_per_oracle_call": len(result.tokens) / result.oracle_calls,
        })
    if args.output:
        with atomic_output(args.output, FILE, args.overwrite) as tmp:
            tmp.write_text("".join(json.dumps(r) + "\n" for r in records))
    if args.prompt is not None:
        print(args.prompt + records[0]["completion"])
        print()
    print(f"{'method':<12} {'prompts':>7} {'new tokens':>10} {'seconds':>9} {'tokens/s':>9} {'tokens/oracle call':>16}")
    print(summary_row(args.method, records))
    return records


if __name__ == "__main__":
    main()
