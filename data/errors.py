"""User-facing input errors: one line that says what is wrong and what to do, exit code 2."""
import functools
import sys


class InputError(Exception):
    """Bad input from the user (missing file, mismatched vocabulary, ...). The message is shown as is."""


def exits_on_input_error(main):
    """Wrap a command-line entry point so an InputError prints one line and exits with code 2."""

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except InputError as err:
            print(f"error: {err}", file=sys.stderr)
            sys.exit(2)
        except KeyboardInterrupt:
            print("interrupted: nothing was written under a final name", file=sys.stderr)
            sys.exit(130)

    return wrapper


def first_line(err: BaseException) -> str:
    """The first line of an exception's message (or its type), for a one-line error."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
