"""HumanEval-style prompts harvested from held-out source files, for offline use: the imports a function
needs, its signature and its docstring, with the rest of its body as the solution. Harvest only from validation
files: never evaluate on training data. They are written in the format `decode.prompts` reads.
"""
import ast
import hashlib
from typing import Iterable

from data.corpus import Document


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
