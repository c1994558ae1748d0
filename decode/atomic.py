"""Outputs that never cost the user anything: checked before work starts, written under a temporary
name, renamed into place when complete, and never put in the place of something they are not.

An output has a kind: a file, or an artifact directory recognised by a marker file inside it (a run's
data/meta.json, a trigram's meta.json, a model's config.json). `check_output` refuses, in one line,
anything else at the path; an artifact of the same kind is replaced only with --overwrite; and nothing the command
reads (its models, tokenizer, trigram, plan, prompts) is ever written over or into, --overwrite or not.
"""
import contextlib
import errno
import fnmatch
import json
import os
import shutil
import signal
import tempfile
from dataclasses import dataclass
from pathlib import Path

from decode.errors import InputError, written


@dataclass(frozen=True)
class Kind:
    """What an output is: a file (marker None) or a directory holding `marker`."""

    name: str
    marker: str | None = None


FILE = Kind("file")
MODEL = Kind("model directory", "config.json")  # a save_pretrained directory



def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _nearest_existing(path: Path) -> Path:
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_not_input(path, reads: dict, flag: str) -> None:
    """Refuse an output that is, lies inside, or holds something the command reads: `reads` maps what each input is
    (a role: "oracle", "prompts", ...) to its path (None: not read)."""
    out = Path(path).resolve()
    for role, source in reads.items():
        if source is not None and (out == (source := Path(source).resolve()) or out.is_relative_to(source)
                                   or source.is_relative_to(out)):
            where = "over" if out == source or source.is_relative_to(out) else "into"
            raise InputError(f"{flag} {path} would write {where} {source}, which this command reads as its {role}; "
                             f"pass another {flag}")


# A run directory's own files (data.prepare's run, its models, plans, trigram, tokenizer and prompts), which only the
# commands that make them write: no other command's output file goes there, whether or not it reads them
RUN_FILES = ("data", "tokenizer", "prompts.jsonl", "oracle*", "draft*", "ngram", "plan*.json")


def check_not_run_file(path, flag: str) -> None:
    """Refuse an output file that is, or lies inside, one of a run directory's own files (RUN_FILES; a run directory
    is one holding data/meta.json)."""
    out = Path(path).absolute()
    for run in out.parents:
        if (run / "data" / "meta.json").is_file():
            own = out.relative_to(run).parts[0]
            if any(fnmatch.fnmatch(own, pattern) for pattern in RUN_FILES):
                raise InputError(f"{flag} {path} would write into {run / own}, one of the run {run}'s own files (its "
                                 f"models, plans, data, trigram, tokenizer and prompts are the commands' that make "
                                 f"them); pass a path outside them, e.g. {run / 'bench' / out.name}")


def check_output(path, kind: Kind = FILE, overwrite: bool = False, flag: str = "the output path",
                 reads: dict | None = None, run_file: bool = False) -> None:
    """Refuse, before any work, an output path whose current content the command may not replace, or that would
    write over or into one of its inputs (`reads`: check_not_input), or an output file inside a run directory's own
    files (check_not_run_file) unless the file is one of them that this command makes (`run_file`: a plan, the
    prompts)."""
    path = Path(path)
    if path.is_symlink() or path.exists():
        if kind.marker is None and path.is_dir():
            raise InputError(f"{path} is a directory, not a file; pass a file path to {flag}")
        if kind.marker is not None and not path.is_dir():
            raise InputError(f"{path} is a file, not a {kind.name} directory; pass another {flag}")
        if kind.marker is not None and not (path / kind.marker).is_file():
            if any(path.iterdir()):
                raise InputError(f"{path} holds files that are not a {kind.name} (no {kind.marker}); "
                                 f"pass an empty or new directory to {flag}")
        elif not overwrite:
            raise InputError(f"{path} already holds a {kind.name}; pass --overwrite to replace it, or another {flag}")
    check_not_input(path, reads or {}, flag)
    if kind is FILE and not run_file:
        check_not_run_file(path, flag)
    parent = _nearest_existing(path.parent)
    if not parent.is_dir():
        raise InputError(f"cannot create {path}: {parent} is a file; pass another {flag}")
    try:
        with tempfile.TemporaryFile(dir=parent):
            pass
    except OSError as err:
        raise InputError(f"cannot write {path} ({err.strerror} in {parent}); pass a writable {flag}") from None


def check_room(path, needed: int, flag: str) -> None:
    """Refuse, before a long run, an output whose disk has less room than the output will take (`needed` bytes, an
    estimate erring high), rather than fail after the work."""
    where = _nearest_existing(Path(path).parent)
    free = shutil.disk_usage(where).free
    if free < needed:
        raise InputError(f"{path} will take about {needed:,} bytes and {where} has {free:,} free; free some space, or "
                         f"pass an {flag} on another disk")


def _make_parents(directory: Path) -> list[Path]:
    """Create `directory` and its missing parents; return those created, deepest first."""
    made = []
    while not directory.exists():
        made.append(directory)
        directory = directory.parent
    for d in reversed(made):
        d.mkdir()
    return made


def _remove_if_empty(directories: list[Path]) -> None:
    for d in directories:
        with contextlib.suppress(OSError):
            d.rmdir()


@contextlib.contextmanager
def _signals_held():
    """SIGINT and SIGTERM wait until the block is done, so a group of renames is never cut in half."""
    held = {signal.SIGINT, signal.SIGTERM}
    old = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


@contextlib.contextmanager
def atomic_outputs(targets: list[tuple[Path, Kind]], overwrite: bool = False):
    """Yield a temporary sibling path per (final path, kind); when the block completes they replace their
    final paths together, each checked again with `check_output`; on failure they are removed, with any
    parent directory this created. The caller creates a file or a directory at each temporary path."""
    finals = [(Path(final), kind) for final, kind in targets]
    for final, kind in finals:  # (where a run's own files may go is the command's first check_output's to say)
        check_output(final, kind, overwrite, run_file=True)
    made = [d for final, _ in finals for d in _make_parents(final.parent)]
    tmps = [final.with_name(f".{final.name}.tmp-{os.getpid()}") for final, _ in finals]
    try:
        for tmp in tmps:
            _remove(tmp)
        yield tmps
        with _signals_held():
            for final, kind in finals:
                check_output(final, kind, overwrite, run_file=True)
            for (final, _), tmp in zip(finals, tmps):
                old = final.with_name(f".{final.name}.old-{os.getpid()}")
                if final.exists():
                    os.replace(final, old)
                os.replace(tmp, final)
                _remove(old)
                written.append(final)
    except BaseException as err:
        for tmp in tmps:
            _remove(tmp)
        _remove_if_empty(made)
        if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
            raise InputError(disk_full(finals[0][0])) from None
        raise


def disk_full(final: Path) -> str:
    """The one line a full disk (or quota) is: the output, the free bytes left where it goes, and what to do; the
    partial output is removed already."""
    where = _nearest_existing(final.parent)
    free = shutil.disk_usage(where).free
    return (f"the disk is full writing {final} ({free:,} bytes free in {where}); nothing was left there: free some "
            f"space, or pass an output on another disk")


@contextlib.contextmanager
def atomic_output(final, kind: Kind = FILE, overwrite: bool = False):
    """One output: see `atomic_outputs`. Without `overwrite` an existing output of the same kind is refused."""
    with atomic_outputs([(Path(final), kind)], overwrite) as (tmp,):
        yield tmp


def write_json(final, data, overwrite: bool = False, indent: int = 2) -> None:
    """`data` as a JSON file, written atomically (see `atomic_outputs` for `overwrite`)."""
    with atomic_output(final, FILE, overwrite) as tmp:
        tmp.write_text(json.dumps(data, indent=indent) + "\n")
