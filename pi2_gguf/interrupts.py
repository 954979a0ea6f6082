"""SIGINT and SIGTERM as an exception (errors.Interrupted), so that an interrupted command unwinds through its
cleanups: the temp file of an output being written is removed, llama's models are closed, and the command
ends with one line and the shell's code for the signal (128 + its number), not a traceback. Python's default
SIGTERM ends the process on the spot and leaves temp files behind."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

from .errors import Interrupted

SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _raise(signum: int, _frame: FrameType | None) -> None:
    raise Interrupted(signum)


@contextmanager
def raised_as_exception() -> Iterator[None]:
    """Within the block, SIGINT and SIGTERM raise Interrupted in the main thread (elsewhere: no change, as
    only the main thread may set handlers)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = {s: signal.signal(s, _raise) for s in SIGNALS}
    try:
        yield
    finally:
        for s, h in before.items():
            signal.signal(s, h)


def exit_code(e: Interrupted) -> int:
    return 128 + e.signum
