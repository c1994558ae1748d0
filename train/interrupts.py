"""Ctrl-C or SIGTERM during training: the optimizer step under way finishes, is saved as a checkpoint, and then the
command stops as an interrupted command does (decode.errors), so that `--resume` continues from the step it reached.
A second signal stops it at once."""
import signal
import threading

from decode.errors import Terminated

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class DeferredInterrupts:
    """While entered (in the main thread, where signals arrive), SIGINT and SIGTERM are noted rather than acted on;
    the first one puts back the handlers that were there before, so a second one acts at once."""

    def __init__(self):
        self.received: int | None = None
        self.previous = {}

    def __enter__(self) -> "DeferredInterrupts":
        if threading.current_thread() is threading.main_thread():
            self.previous = {sig: signal.signal(sig, self.note) for sig in SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        self.restore()

    def note(self, signum, frame) -> None:
        self.received = signum
        self.restore()

    def restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        self.previous = {}

    def requested(self, accelerator) -> bool:
        """Whether to stop after this step: a signal reached this process or another of the run's (accelerate's
        trigger, so that every process saves the same step)."""
        if self.received is not None:
            accelerator.set_trigger()
        return accelerator.check_trigger()

    def stop(self) -> BaseException:
        """What the command stops with: as if the signal had been acted on when it came."""
        return Terminated() if self.received == signal.SIGTERM else KeyboardInterrupt()
