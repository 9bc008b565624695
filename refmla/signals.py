"""SIGINT and SIGTERM as exceptions, so every command ends promptly through its ``finally`` blocks.

SIGINT is Python's KeyboardInterrupt (exit 130); SIGTERM becomes :class:`Terminated` (exit 143)
instead of an immediate death that would leave worker processes (and the resource tracker they
hold open) running. A write that must not be cut (a ``--json`` document) runs with both deferred.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Iterator

EXIT_SIGINT, EXIT_SIGTERM = 128 + signal.SIGINT, 128 + signal.SIGTERM  # 130, 143
STOPPING = (signal.SIGINT, signal.SIGTERM)


class Terminated(BaseException):
    """SIGTERM arrived (a BaseException like KeyboardInterrupt: ``except Exception`` never eats it)."""


def _raise_terminated(signum, frame) -> None:
    raise Terminated()


@contextlib.contextmanager
def sigterm_raises() -> Iterator[None]:
    """Within the block SIGTERM raises Terminated in the main thread (elsewhere: no change)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """SIGINT / SIGTERM held until the block ends (then delivered): a document is written whole."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, STOPPING)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def ignore_sigint() -> None:
    """For worker processes: the terminal's SIGINT goes to the whole group; the parent stops them."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


__all__ = ["EXIT_SIGINT", "EXIT_SIGTERM", "Terminated", "ignore_sigint", "signals_deferred", "sigterm_raises"]
