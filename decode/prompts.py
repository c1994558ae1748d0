"""Prompt sets in HumanEval format: one JSON object per line with at least `task_id` and `prompt`.

Two sources: the hub's `openai_humaneval` and a JSONL file (optionally gzipped), such as the one a prepared
run harvests from its held-out source files.
"""
import gzip
import json
import zlib
from collections.abc import Iterable
from pathlib import Path

from decode.errors import InputError, check_path, first_line

HUMANEVAL = "humaneval"


def read_jsonl(path) -> list[dict]:
    path = Path(path)
    check_path(path, False, "prompts file", "pass --prompts humaneval or a .jsonl[.gz] file")
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
