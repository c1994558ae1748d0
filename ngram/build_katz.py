"""Build the Katz backoff trigram: counts, Good-Turing discounts, backoff weights, ARPA file and
top-K successor tables.

    python ngram/build_katz.py --out RUN/ngram                         # from RUN/data (the corpus)
    python ngram/build_katz.py --from-draft RUN/draft --num-tokens 120e6 --temperature 1.5 --out RUN/ngram
    python ngram/build_katz.py --tokens FILE --vocab-size V --out DIR  # token ids, one document per line

Writes OUT/model.arpa (kenlm.Model loads it), OUT/successors.npz and OUT/meta.json.
"""
import argparse
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run by its path: the repository's folders import

import numpy as np

from data.shards import open_split, read_meta, split_documents
from decode.atomic import Kind, atomic_output, check_output
from decode.cli.help import HelpFormatter
from decode.errors import InputError, check_path, exits_on_input_error
from ngram import counts as ngram_counts
from ngram import katz, successors
from ngram.arpa import write_arpa
from ngram.bench_lookup import lookup_cost_us

TRIGRAM = Kind("trigram directory", "meta.json")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python ngram/build_katz.py",
        description="Build a Katz backoff trigram over token ids: ARPA file, successor tables, perplexity report.",
        formatter_class=HelpFormatter,
    )
    p.add_argument("--out", required=True, type=Path, help="output directory (RUN/ngram)")
    p.add_argument("--data", type=Path, help="prepared data directory: training text (unless --from-draft), validation "
                                             "text and tokenizer (default: the data/ beside --out)")
    p.add_argument("--tokens", type=Path, help="instead of --data: a text file of whitespace-separated token ids, one document per line")
    p.add_argument("--from-draft", type=Path, metavar="DIR", help="sample the training text from this draft model")
    p.add_argument("--vocab-size", type=int, help="with --tokens: vocabulary size (ids must be below it)")
    p.add_argument("--eos-id", type=int, help="with --tokens: the end-of-text id that stands for </s> (default: the run's tokenizer's, else 0)")
    p.add_argument("--val-tokens", type=Path, help="with --tokens: held-out documents in the same format, for perplexity")
    p.add_argument("--num-tokens", type=float, default=1e6, help="with --from-draft: tokens to sample")
    p.add_argument("--temperature", type=float, default=1.5, help="with --from-draft: sampling temperature")
    p.add_argument("--max-tokens", type=float, default=None, help="use at most this many training tokens")
    p.add_argument("--discount-up-to", type=int, default=5, metavar="K", help="Good-Turing discounts for counts 1..K")
    p.add_argument("--successors", type=int, default=16, help="the most probable next tokens kept per context for drafting")
    p.add_argument("--overwrite", action="store_true", help="replace a trigram directory already at --out")
    args = p.parse_args(argv)
    if args.tokens is not None and (args.data is not None or args.from_draft is not None):
        p.error("--tokens replaces --data and --from-draft; pass one source of training text")
    if args.tokens is None and args.vocab_size is not None:
        p.error("--vocab-size goes with --tokens (otherwise the tokenizer's vocabulary is used)")
    if args.tokens is not None and args.vocab_size is None:
        p.error("--tokens needs --vocab-size")
    if args.discount_up_to < 1 or args.successors < 1:
        p.error("--discount-up-to and --successors must be positive")
    if (args.max_tokens is not None and args.max_tokens < 1) or args.num_tokens < 1 or not 0 < args.temperature < math.inf:
        p.error("--max-tokens and --num-tokens must be at least 1, and --temperature positive and finite")
    if args.vocab_size is not None and args.vocab_size < 1:
        p.error("--vocab-size must be positive")
    if args.eos_id is not None and not (args.tokens is not None and 0 <= args.eos_id < args.vocab_size):
        p.error(f"--eos-id goes with --tokens and must lie in the vocabulary 0..{(args.vocab_size or 1) - 1}")
    return args


def read_token_file(path: Path, vocab_size: int) -> list[np.ndarray]:
    check_path(path, False, "token file", "pass a file of token ids, a document a line")
    docs = []
    with open(path, encoding="utf-8") as f:
        try:
            lines = list(f)
        except UnicodeDecodeError:
            raise InputError(f"{path} is not a text file of token ids (it is not UTF-8); write one document of "
                             f"whitespace-separated ids per line") from None
        for lineno, line in enumerate(lines, 1):
            try:
                ids = np.array([int(t) for t in line.split()], dtype=np.int64)
            except ValueError:
                bad = next(t for t in line.split() if not t.lstrip("-").isdigit())
                raise InputError(f"{path}:{lineno}: {bad!r} is not an integer token id") from None
            if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
                bad = ids.max() if ids.max() >= vocab_size else ids.min()
                raise InputError(f"{path}:{lineno}: token id {bad} is outside the vocabulary 0..{vocab_size - 1}; check --vocab-size")
            docs.append(ids)
    if not sum(d.size for d in docs):
        raise InputError(f"token file {path} holds no tokens")
    return docs


def run_vocabulary(run: Path) -> tuple[int, int] | None:
    """(vocabulary size, end-of-text id) of the tokenizer in RUN, if there is one."""
    path = run / "tokenizer" / "tokenizer.json"
    if not path.is_file():
        return None
    from tokenizers import Tokenizer

    from data.tokenizer import END_OF_TEXT

    tokenizer = Tokenizer.from_file(str(path))
    return tokenizer.get_vocab_size(with_added_tokens=True), tokenizer.token_to_id(END_OF_TEXT)


def load_documents(args) -> tuple[list[np.ndarray], list[np.ndarray], int, int, str]:
    """Training documents, held-out documents, vocabulary size, end-of-text id, and a description."""
    run_vocab = run_vocabulary(args.out.parent)
    if args.tokens is not None:
        vocab_size = args.vocab_size
        eos_id = args.eos_id if args.eos_id is not None else (run_vocab[1] if run_vocab else 0)
        train = read_token_file(args.tokens, vocab_size)
        val = read_token_file(args.val_tokens, vocab_size) if args.val_tokens else []
        source = str(args.tokens)
    else:
        data = args.data or args.out.parent / "data"
        check_path(data, True, "data directory", "run `python -m data.prepare --out RUN` or pass --data")
        meta = read_meta(data)
        vocab_size, eos_id = meta["vocab_size"], meta["eos_id"]
        val = split_documents(np.asarray(open_split(data, "val")), eos_id)
        if args.from_draft is not None:
            from ngram.draft_samples import check_draft_tokenizer, sample_documents

            check_draft_tokenizer(args.from_draft, (data / meta["tokenizer"]).resolve())
            train = list(sample_documents(args.from_draft, int(args.num_tokens), args.temperature))
            source = f"{int(args.num_tokens)} tokens sampled from {args.from_draft} at T={args.temperature}"
        else:
            train = split_documents(np.asarray(open_split(data, "train")), eos_id)
            source = str(data)
    if run_vocab is not None and run_vocab[0] != vocab_size:
        raise InputError(
            f"vocabulary size {vocab_size} does not match the tokenizer in {args.out.parent} ({run_vocab[0]} tokens); "
            f"pass the matching --vocab-size or write the model elsewhere"
        )
    if args.max_tokens is not None:
        kept, total = [], 0
        for doc in train:
            if total >= args.max_tokens:
                break
            kept.append(doc)
            total += doc.size
        train = kept
    return train, val, vocab_size, eos_id, source


@exits_on_input_error
def main(argv=None) -> dict:
    args = parse_args(argv)
    reads = {"data": None if args.tokens else args.data or args.out.parent / "data", "tokens": args.tokens,
             "validation tokens": args.val_tokens, "draft": args.from_draft}
    check_output(args.out, TRIGRAM, args.overwrite, "--out", reads)
    start = time.time()
    train, val, vocab_size, eos_id, source = load_documents(args)
    vocab = ngram_counts.Vocabulary(vocab_size)
    counts = ngram_counts.count(train, vocab, total_tokens=sum(d.size for d in train))
    model = katz.estimate(counts, args.discount_up_to)
    table = successors.build(model, args.successors, eos_id)
    perplexity = {f"order_{n}": model.perplexity(val, n) for n in (1, 2, 3)} if val else {}
    meta = {
        "vocab_size": vocab_size, "eos_id": eos_id, "order": 3, "k": args.discount_up_to, "top_k": args.successors, "source": source,
        "training_tokens": int(sum(d.size for d in train)), "documents": len(train),
        "ngram_types": [int(k.size) for k in counts.keys],
        "discounts": [d[1:].round(6).tolist() for d in model.discounts], "notes": model.notes,
        "validation_perplexity": {k: v[0] for k, v in perplexity.items()},
        "validation_zero_probabilities": {k: v[1] for k, v in perplexity.items()},
    }
    with atomic_output(args.out, TRIGRAM, args.overwrite) as tmp:
        tmp.mkdir()
        write_arpa(model, tmp / "model.arpa")
        table.save(tmp / "successors.npz")
        meta["seconds"] = round(time.time() - start, 1)
        meta["lookup_us_per_context"] = round(lookup_cost_us(table), 3)
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    size = sum(f.stat().st_size for f in args.out.iterdir()) / 1e6
    print(f"wrote {args.out}/ in {meta['seconds']}s ({size:.1f} MB): model.arpa, successors.npz, meta.json")
    print(f"  trained on {meta['training_tokens']:,} tokens in {len(train)} documents ({source})")
    for n in (1, 2, 3):
        d = ", ".join(f"{x:.3f}" for x in meta["discounts"][n - 1])
        print(f"  order {n}: {meta['ngram_types'][n - 1]:,} n-grams; Good-Turing d_1..d_{args.discount_up_to} = {d}")
    for note in model.notes:
        print(f"  note: {note}")
    if perplexity:
        print("  validation perplexity: " + ", ".join(f"{k.replace('_', ' ')} {v[0]:.2f}" for k, v in perplexity.items()))
        if any(v[1] for v in perplexity.values()):
            print(f"  (zero-probability events left out, as SRILM does: {meta['validation_zero_probabilities']})")
    print(f"  successor lookup: {meta['lookup_us_per_context']} us per context (batch of 64)")
    return meta


if __name__ == "__main__":
    main()
