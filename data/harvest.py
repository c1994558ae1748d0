"""HumanEval-style prompts harvested from held-out source files, for offline use: the imports a function
needs, its signature and its docstring, with the rest of its body as the solution. Harvest only from validation
files: never evaluate on training data. They are written in the format `decode.prompts` reads.

`data.prepare` harvests a run's prompts from its validation split. This command harvests them from other code, the
kind a user decodes, for `decode.plan --prompts` and `decode.bench --prompts`:

    python -m data.harvest numpy pydantic click --run RUN --out other-code.jsonl
    python -m data.harvest ~/src/myproject --run RUN --out mine.jsonl --count 100
"""
import argparse
import ast
import hashlib
import importlib.util
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path

from data import tokenizer as tok
from data.corpus import Document, local_documents
from decode.atomic import atomic_output, check_not_input, check_output
from decode.cli.help import HelpFormatter
from decode.errors import InputError, exits_on_input_error
from decode.prompts import write_jsonl
from decode.tokenizer import load_tokenizer

PROG = "python -m data.harvest"


def _names_used(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def _bound_names(node: ast.Import | ast.ImportFrom) -> set[str]:
    return {(a.asname or a.name).split(".")[0] for a in node.names}


def harvest_file(doc: Document) -> list[dict]:
    """HumanEval-style prompts from the top-level functions of one file that have a docstring and a body.

    The prompt is the imports the function uses, then its decorators, signature and docstring; the
    rest of the body is kept as `canonical_solution`.
    """
    text = doc.text.replace("\r\n", "\n").replace("\r", "\n")
    try:
        module = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    lines = text.split("\n")
    imports = [n for n in module.body if isinstance(n, (ast.Import, ast.ImportFrom)) and not any(a.name == "*" for a in n.names)]
    prompts = []
    for fn in module.body:
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) or fn.name.startswith("test"):
            continue
        if ast.get_docstring(fn) is None or len(fn.body) < 2:
            continue
        docstring = fn.body[0]
        if lines[docstring.end_lineno - 1][docstring.end_col_offset :].strip():
            continue  # code follows the docstring on its line
        start = min([fn.lineno] + [d.lineno for d in fn.decorator_list])
        header = "\n".join(lines[start - 1 : docstring.end_lineno]) + "\n"
        used = _names_used(fn)
        needed = [ast.get_source_segment(text, n) for n in imports if _bound_names(n) & used]
        prompt = ("\n".join(needed) + "\n\n\n" if needed else "") + header
        try:
            ast.parse(prompt)
        except SyntaxError:
            continue
        prompts.append(
            {
                "task_id": f"{doc.name}::{fn.name}",
                "prompt": prompt,
                "canonical_solution": "\n".join(lines[docstring.end_lineno : fn.end_lineno]) + "\n",
                "entry_point": fn.name,
            }
        )
    return prompts


def harvest(
    documents: Iterable[Document],
    count: int,
    per_file: int = 12,
    fits=lambda prompt: True,
) -> list[dict]:
    """Up to `count` prompts, at most `per_file` from each file, in a deterministic shuffled order.

    `fits(prompt)` filters prompts (the caller's token-length limit).
    """
    candidates = []
    for doc in documents:
        candidates += [p for p in harvest_file(doc) if fits(p["prompt"])][:per_file]
    candidates.sort(key=lambda p: hashlib.sha256(p["task_id"].encode()).digest())
    return candidates[:count]


def within(tokenizer, max_tokens: int) -> Callable[[str], bool]:
    """Whether a prompt is at most `max_tokens` long in `tokenizer`'s tokens (harvest's `fits`)."""
    return lambda prompt: len(tok.encode_documents(tokenizer, [prompt])[0]) <= max_tokens


def source_dir(source: str) -> Path:
    """A source named on the command line: a directory, or an installed package's name (its directory)."""
    if Path(source).is_dir():
        return Path(source)
    try:
        spec = importlib.util.find_spec(source) if source.isidentifier() else None
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise InputError(f"{source} is neither a directory nor an installed package; pass a directory of Python "
                         f"files or a package's import name (numpy)")
    return Path(list(spec.submodule_search_locations)[0])


def documents(roots: list[Path], skipped: Counter) -> Iterable[Document]:
    """The .py files under each root, named from the root's own name (numpy/linalg/_linalg.py)."""
    for root in roots:
        for doc in local_documents([root], skipped):
            yield Document(f"{root.resolve().name}/{doc.name}", doc.text)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog=PROG, formatter_class=HelpFormatter,
        description="Harvest HumanEval-style prompts (a function's imports, signature and docstring) from Python "
                    "code the run did not train on, to calibrate decode.plan and to benchmark on code like yours.")
    p.add_argument("sources", nargs="+", metavar="SOURCE",
                   help="a directory of Python files, or an installed package's import name (numpy)")
    p.add_argument("--run", required=True, type=Path, help="run directory whose tokenizer measures the prompts (RUN)")
    p.add_argument("--out", required=True, type=Path, help="JSON-lines file to write, in decode.prompts' format")
    p.add_argument("--count", type=int, default=200, help="most prompts to keep, in a fixed shuffled order")
    p.add_argument("--per-file", type=int, default=2, help="most prompts from one file, so no file dominates")
    p.add_argument("--max-prompt-tokens", type=int, default=384,
                   help="longest prompt kept, in the run's tokens (the default leaves room for decoding's 128 new "
                        "tokens in the presets' 512-token context)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    args = p.parse_args(argv)
    if min(args.count, args.per_file, args.max_prompt_tokens) < 1:
        p.error("--count, --per-file and --max-prompt-tokens must be positive")
    return args


@exits_on_input_error
def main(argv=None) -> None:
    args = parse_args(argv)
    roots = [source_dir(s) for s in args.sources]
    for root in roots:
        check_not_input(args.out, {"source": root}, "--out")
    check_output(args.out, overwrite=args.overwrite, flag="--out", run_file=True)  # a run's prompts are its to make
    tokenizer = load_tokenizer(args.run / "tokenizer")
    skipped: Counter = Counter()
    harvested = harvest(documents(roots, skipped), args.count, args.per_file, within(tokenizer, args.max_prompt_tokens))
    if not harvested:
        raise InputError(f"no function with a docstring of at most {args.max_prompt_tokens} tokens in "
                         f"{', '.join(map(str, roots))}; pass other sources or raise --max-prompt-tokens")
    with atomic_output(args.out, overwrite=args.overwrite) as tmp:
        write_jsonl(harvested, tmp)
    files = len({p["task_id"].split("::")[0] for p in harvested})
    print(f"wrote {args.out}: {len(harvested)} prompts from {files} files of {', '.join(map(str, roots))}"
          + (f" (skipped: {', '.join(f'{n} {why}' for why, n in sorted(skipped.items()))})" if skipped else ""))


if __name__ == "__main__":
    main()
