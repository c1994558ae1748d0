"""Prepare a run directory: corpus -> tokenizer -> token shards -> held-out prompts.

    python -m data.prepare --out runs/demo                       # the standard library, BPE tokenizer
    python -m data.prepare --source local --path DIR [DIR ...] --out RUN
    python -m data.prepare --source stack --tokenizer gpt2 --max-bytes 2e9 --out RUN   # the paper's

Writes RUN/tokenizer, RUN/data/{train.bin,val.bin,meta.json} and RUN/prompts.jsonl. Every file is
written under a temporary name and renamed when complete; RUN/data/meta.json is renamed last, so
its presence means the run directory is complete.
"""
import argparse
import time
from collections import Counter
from pathlib import Path

from tqdm.auto import tqdm

from data import corpus, harvest, shards
from data import tokenizer as tok
from decode.atomic import FILE, Kind, atomic_outputs, check_not_input, check_output
from decode.cli.help import HelpFormatter
from decode.errors import InputError, exits_on_input_error
from decode.prompts import write_jsonl
from decode.tokenizer import load_tokenizer

ENCODE_BATCH = 256


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m data.prepare",
        description="Build a run directory's tokenizer, token shards and held-out prompts from Python sources.",
        formatter_class=HelpFormatter,
    )
    p.add_argument("--out", required=True, type=Path, help="run directory to write (RUN)")
    p.add_argument("--source", choices=["local", "stack"], default="local",
                   help="local: directories of .py files; stack: The Stack's Python subset from the hub (needs a token)")
    p.add_argument("--path", nargs="+", type=Path, default=None,
                   help="with --source local: directories to read (default: this interpreter's standard library)")
    p.add_argument("--stack-dataset", choices=corpus.STACK_DATASETS, default=corpus.STACK_DATASETS[0],
                   help="with --source stack: which dataset")
    p.add_argument("--tokenizer", default="bpe",
                   help="'bpe' trains a byte-level BPE on the training split; otherwise a pretrained name or directory (e.g. gpt2)")
    p.add_argument("--vocab-size", type=int, default=8192, help="with --tokenizer bpe: vocabulary size")
    p.add_argument("--val-fraction", type=float, default=0.1, help="share of documents held out for validation")
    p.add_argument("--max-bytes", type=float, default=None,
                   help="stop reading after this many bytes of kept source (default: all for local, 1e9 for stack)")
    p.add_argument("--max-docs", type=int, default=None, help="stop reading after this many kept documents")
    p.add_argument("--num-prompts", type=int, default=164, help="prompts to harvest from validation files (0: none)")
    p.add_argument("--max-prompt-tokens", type=int, default=256, help="longest harvested prompt, in tokens")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the tokenizer, data and prompts of a run that holds no trained models yet")
    args = p.parse_args(argv)
    if not 0 < args.val_fraction < 1:
        p.error("--val-fraction must be between 0 and 1")
    if args.num_prompts < 0 or args.max_prompt_tokens < 1:
        p.error("--num-prompts must be 0 or more and --max-prompt-tokens positive")
    if args.source == "stack" and args.max_bytes is None:
        args.max_bytes = 1e9
    if args.path is not None and args.source != "local":
        p.error("--path applies to --source local only")
    return args


RUN = Kind("prepared run", f"data/{shards.META}")
TOKENIZER = Kind("tokenizer", "tokenizer_config.json")
DATA = Kind("prepared data directory", shards.META)
TRAINED = ("oracle", "draft", "ngram")  # what a run holds that was built on its tokenizer


def outputs(run: Path) -> list[tuple[Path, Kind]]:
    """What prepare writes into RUN; data/ last, so its meta.json marks a complete run."""
    return [(run / "tokenizer", TOKENIZER), (run / "prompts.jsonl", FILE), (run / "data", DATA)]


def check_outputs(run: Path, overwrite: bool, sources: list[Path]) -> None:
    """Refuse before any work an --out whose parts prepare may not replace, or that holds the corpus it reads."""
    for path in sources:
        check_not_input(run, {"corpus": path}, "--out")
    check_output(run, RUN, overwrite, "--out")
    for path, kind in outputs(run):
        check_output(path, kind, overwrite, "--out", run_file=True)  # the run's own files are prepare's to make
    trained = [name for name in TRAINED if (run / name).exists()]
    if overwrite and trained:
        raise InputError(f"{run} holds {', '.join(trained)} built with its current tokenizer, which --overwrite would "
                         f"replace; move them out of {run} first, or pass another --out")


def read_corpus(args, skipped: Counter) -> dict[str, list[corpus.Document]]:
    if args.source == "local":
        roots = args.path or [corpus.stdlib_dir()]
        documents = corpus.local_documents(roots, skipped)
        sources = [str(Path(r).resolve()) for r in roots]
    else:
        documents = tqdm(corpus.stack_documents(args.stack_dataset), desc="streaming", unit="doc")
        sources = [f"hf://{args.stack_dataset}/{corpus.STACK_DATA_DIR}"]
    max_bytes = int(args.max_bytes) if args.max_bytes is not None else None
    splits = corpus.collect(documents, args.val_fraction, skipped, max_bytes, args.max_docs, reserved=tok.END_OF_TEXT)
    for name, docs in splits.items():
        if not docs:
            raise InputError(
                f"the {name} split is empty ({sum(map(len, splits.values()))} usable documents); "
                f"add sources or raise --max-docs/--max-bytes"
            )
    args.sources = sources
    return splits


def write_split(path: Path, docs, tokenizer, dtype) -> int:
    def encoded():
        for i in tqdm(range(0, len(docs), ENCODE_BATCH), desc=f"tokenising {path.stem}", unit="batch"):
            yield from tok.encode_documents(tokenizer, [d.text for d in docs[i : i + ENCODE_BATCH]])

    return shards.write_tokens(path, encoded(), tokenizer.eos_token_id, dtype)


@exits_on_input_error
def main(argv=None) -> None:
    args = parse_args(argv)
    start = time.time()
    run = args.out
    check_outputs(run, args.overwrite, args.path or [corpus.stdlib_dir()] if args.source == "local" else [])
    if args.tokenizer == "bpe":
        tok.check_vocab_size(args.vocab_size)
        tokenizer = None  # trained on the training split once it is read
    else:
        tokenizer = load_tokenizer(args.tokenizer)  # before the corpus, so a hub error comes at once

    skipped: Counter = Counter()
    splits = read_corpus(args, skipped)
    if tokenizer is None:
        tokenizer = tok.train_bpe([d.text for d in splits["train"]], args.vocab_size)
    vocab_size = len(tokenizer)
    dtype = shards.token_dtype(vocab_size)

    harvested = harvest.harvest(splits["val"], args.num_prompts, fits=harvest.within(tokenizer, args.max_prompt_tokens))

    with atomic_outputs(outputs(run), args.overwrite) as (tokenizer_dir, prompts_file, data_dir):
        tokenizer.save_pretrained(tokenizer_dir)
        write_jsonl(harvested, prompts_file)
        data_dir.mkdir()
        counts = {name: write_split(data_dir / f"{name}.bin", docs, tokenizer, dtype) for name, docs in splits.items()}
        meta = {
            "vocab_size": vocab_size,
            "dtype": dtype.name,
            "eos_id": tokenizer.eos_token_id,
            "tokenizer": "../tokenizer",
            "tokenizer_source": args.tokenizer,
            "sources": args.sources,
            "val_fraction": args.val_fraction,
            "splits": {
                name: {"documents": len(docs), "tokens": counts[name], "bytes": sum(len(d.text.encode()) for d in docs)}
                for name, docs in splits.items()
            },
            "skipped": dict(skipped),
            "prompts": len(harvested),
        }
        shards.write_meta(data_dir, meta)

    print(f"wrote {run}/ in {time.time() - start:.0f}s")
    print(f"  tokenizer/      vocabulary {vocab_size} ({args.tokenizer})")
    for name in corpus.SPLITS:
        s = meta["splits"][name]
        print(f"  data/{name}.bin  {s['tokens']:,} tokens from {s['documents']} files ({s['bytes'] / 1e6:.1f} MB), {dtype.name}")
    print(f"  prompts.jsonl   {len(harvested)} prompts harvested from validation files")
    if skipped:
        print("  skipped: " + ", ".join(f"{n} {why}" for why, n in sorted(skipped.items())))
    if len(harvested) < args.num_prompts:
        print(f"  note: asked for {args.num_prompts} prompts, found {len(harvested)}; raise --val-fraction for more")


if __name__ == "__main__":
    main()
