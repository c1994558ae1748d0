"""Prompt sets in HumanEval format: one JSON object per line with at least `task_id` and `prompt`.

Three sources: the hub's `openai_humaneval`, a JSONL file (optionally gzipped), and a harvester that
builds HumanEval-style prompts (the imports a function needs, its signature and its docstring) from
held-out source files, for offline use. Harvest only from validation files: never evaluate on
training data.
"""
import ast
import gzip
import hashlib
import json
import zlib
from pathlib import Path
from typing import Iterable

from data.corpus import Document
from data.errors import InputError, first_line

HUMANEVAL = "humaneval"


def read_jsonl(path) -> list[dict]:
    path = Path(path)
    if not path.is_file():
        raise InputError(f"prompts file {path} does not exist; pass --prompts humaneval or a .jsonl[.gz] file")
    opener = gzip.open if path.suffix == ".gz" else open
    records = []
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as err:
                    raise InputError(f"{path}:{lineno}: not valid JSON ({err.msg}); expected one object per line") from None
                if not isinstance(record, dict) or not isinstance(record.get("task_id"), (str, int)):
                    raise InputError(f"{path}:{lineno}: expected an object with a 'task_id'")
                if not isinstance(record.get("prompt"), str) or not record["prompt"]:
                    raise InputError(f"{path}:{lineno}: 'prompt' must be a non-empty string")
                records.append(record)
    except (OSError, EOFError, UnicodeDecodeError, zlib.error) as err:  # zlib: a damaged gzip stream after its header
        raise InputError(f"cannot read prompts file {path} ({first_line(err)}); expected UTF-8 JSON lines, optionally "
                         f"gzipped") from None
    if not records:
        raise InputError(f"prompts file {path} holds no prompts")
    return records


def write_jsonl(records: Iterable[dict], path) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")


def humaneval() -> list[dict]:
    """The 164 HumanEval problems from the hub (`openai_humaneval`)."""
    try:
        import datasets

        rows = datasets.load_dataset("openai_humaneval", split="test")
    except Exception as err:  # offline, DNS, hub errors
        reason = first_line(err)
        raise InputError(
            f"cannot load openai_humaneval from the hub ({reason}); offline, pass --prompts RUN/prompts.jsonl"
        ) from None
    return [dict(row) for row in rows]


def load_prompts(spec: str, limit: int | None = None) -> list[dict]:
    """`humaneval` or a path to a .jsonl / .jsonl.gz file; the first `limit` prompts."""
    records = humaneval() if spec == HUMANEVAL else read_jsonl(spec)
    return records[:limit] if limit is not None else records


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
