"""User-facing input errors: one line that says what is wrong and what to do, exit code 2."""
import functools
import gc
import signal
import sys
import threading
from pathlib import Path


class InputError(Exception):
    """Bad input from the user (missing file, mismatched vocabulary, ...). The message is shown as is; `field` names
    the setting at fault, where one is (the server's error object reports it as its `param`)."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


written: list = []  # paths the running command's outputs were renamed into (decode.atomic), for an honest interrupt message


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised like Ctrl-C so that temporary outputs are removed on the way out."""


def _terminate(signum, frame):
    raise Terminated()


def interrupt_message(stopped: str) -> str:
    """What an interrupted command says: the truth about what it wrote before stopping."""
    if not written:
        return f"{stopped}: nothing was written; temporary files were removed"
    return f"{stopped} after writing {', '.join(map(str, written))}; temporary files were removed"


def exits_on_input_error(main):
    """Wrap a command-line entry point so an InputError prints one line and exits with code 2, and an
    interrupt (Ctrl-C, SIGTERM) removes temporary outputs and says what was written."""

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        written.clear()
        in_main_thread = threading.current_thread() is threading.main_thread()  # signals go there only
        previous = signal.signal(signal.SIGTERM, _terminate) if in_main_thread else None
        if not args and not kwargs:  # a command run from the command line (tests pass their argv): what the imports
            gc.freeze()  # made lives until the process exits, so neither a collection nor the exit need scan it
        try:
            return main(*args, **kwargs)
        except InputError as err:
            print(f"error: {err}", file=sys.stderr)
            sys.exit(2)
        except Terminated:
            print(interrupt_message("terminated"), file=sys.stderr)
            sys.exit(143)
        except KeyboardInterrupt:
            print(interrupt_message("interrupted"), file=sys.stderr)
            sys.exit(130)
        finally:
            if in_main_thread:
                signal.signal(signal.SIGTERM, previous)

    return wrapper


def path_fault(path, directory: bool) -> str | None:
    """What is wrong with `path` as a directory (or a file) to read, in words ("does not exist", "is a file, not a
    directory", ...); None where nothing is."""
    path = Path(path)
    if directory:
        return None if path.is_dir() else "is a file, not a directory" if path.exists() else "does not exist"
    if path.is_file():
        return None
    return ("is a directory, not a file" if path.is_dir() else "is not a regular file" if path.exists()
            else "does not exist")


def check_path(path, directory: bool, what: str, fix: str) -> None:
    """Refuse a path the command reads that is not there, or not a directory (a file): "{what} {path} {fault}; {fix}"."""
    fault = path_fault(path, directory)
    if fault is not None:
        raise InputError(f"{what} {path} {fault}; {fix}")


def first_line(err: BaseException) -> str:
    """The first line of an exception's message (or its type), for a one-line error."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
