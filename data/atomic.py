"""Write files and directories under a temporary name and rename them into place when complete."""
import contextlib
import os
import shutil
from pathlib import Path


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


@contextlib.contextmanager
def atomic_output(final):
    """Yield a temporary sibling path of `final`; on success it replaces `final`, on failure it is removed.

    Works for a file or a directory: the caller creates whatever it likes at the yielded path.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    _remove(tmp)
    try:
        yield tmp
    except BaseException:
        _remove(tmp)
        raise
    if final.exists():
        old = final.with_name(f".{final.name}.old-{os.getpid()}")
        os.replace(final, old)
        os.replace(tmp, final)
        _remove(old)
    else:
        os.replace(tmp, final)
