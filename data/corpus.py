"""Python source documents from local directories or The Stack: one path for both sources.

Documents are read, filtered (unreadable, non-UTF-8, empty), deduplicated by content and split into
train/validation by a hash of the content, so a file never lands in both splits and the split does
not depend on the order in which files are found.
"""
import hashlib
import itertools
import sysconfig
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

from decode.errors import InputError, check_path, first_line

STACK_DATASETS = ("bigcode/the-stack-dedup", "bigcode/the-stack")
STACK_DATA_DIR = "data/python"
SPLITS = ("train", "val")


@dataclass(frozen=True)
class Document:
    name: str  # path relative to its source directory, or the repository path on the hub
    text: str


def stdlib_dir() -> Path:
    """This interpreter's standard library: the offline default corpus."""
    return Path(sysconfig.get_paths()["stdlib"])


def python_files(root: Path) -> list[Path]:
    """Every .py file below root, sorted; installed packages (site-packages) are not the stdlib."""
    return sorted(p for p in root.rglob("*.py") if "site-packages" not in p.relative_to(root).parts)


def local_documents(roots: Iterable[Path], skipped: Counter) -> Iterator[Document]:
    files = []
    for root in map(Path, roots):
        check_path(root, True, "source directory", "pass a directory of Python sources")
        found = python_files(root)
        if not found:
            raise InputError(f"no .py files under {root}; pass a directory of Python sources")
        files += [(root, f) for f in found]
    for root, path in tqdm(files, desc="reading files", unit="file"):
        try:
            raw = path.read_bytes()
        except OSError:
            skipped["unreadable"] += 1
            continue
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            skipped["not UTF-8"] += 1
            continue
        yield Document(str(path.relative_to(root)), text)


def stack_documents(dataset: str) -> Iterator[Document]:
    """Stream The Stack's Python subset. Needs network access and a hub token (gated dataset)."""
    try:
        import datasets

        stream = datasets.load_dataset(dataset, data_dir=STACK_DATA_DIR, split="train", streaming=True)
        rows = iter(stream)
        first = next(rows)
    except Exception as err:  # the hub raises many kinds: offline, gated, missing token, DNS
        reason = first_line(err)
        raise InputError(
            f"cannot stream {dataset} from the Hugging Face hub ({reason}); it needs network access and a "
            f"token with the dataset's terms accepted (`hf auth login`); offline, use --source local"
        ) from None
    for row in itertools.chain([first], rows):
        name = row.get("max_stars_repo_path") or row.get("path") or row.get("hexsha", "")
        yield Document(str(name), row["content"])


def split_of(text: str, val_fraction: float) -> str:
    """'val' for a deterministic `val_fraction` of contents, else 'train'."""
    bucket = int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "big") / 2**64
    return "val" if bucket < val_fraction else "train"


def collect(
    documents: Iterable[Document],
    val_fraction: float,
    skipped: Counter,
    max_bytes: int | None = None,
    max_docs: int | None = None,
    reserved: str | None = None,
) -> dict[str, list[Document]]:
    """Deduplicate, drop empty documents (and any containing the `reserved` separator), split, cap.

    The caps count kept documents of both splits together and stop reading once reached.
    """
    seen: set[bytes] = set()
    splits: dict[str, list[Document]] = {s: [] for s in SPLITS}
    total_bytes = total_docs = 0
    for doc in documents:
        if not doc.text.strip():
            skipped["empty"] += 1
            continue
        if reserved is not None and reserved in doc.text:
            skipped["contain the end-of-text marker"] += 1
            continue
        digest = hashlib.sha256(doc.text.encode("utf-8")).digest()
        if digest in seen:
            skipped["duplicate"] += 1
            continue
        seen.add(digest)
        splits[split_of(doc.text, val_fraction)].append(doc)
        total_docs += 1
        total_bytes += len(doc.text.encode("utf-8"))
        if (max_docs is not None and total_docs >= max_docs) or (max_bytes is not None and total_bytes >= max_bytes):
            break
    return splits
