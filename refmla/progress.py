"""A progress bar on stderr for long runs: live on a terminal, one line per item when redirected.

tqdm draws the live bar when it is importable (it ships with SGLang); refmla stays installable
with ``--no-deps``, so without it a plain carriage-return bar is drawn instead.
"""

from __future__ import annotations

import sys
from typing import Optional, TextIO

from refmla.util import PrintableStream, printable


class Progress:
    """``step(label)`` after each of ``total`` items, ``close()`` at the end. Silent for one item."""

    def __init__(self, total: int, stream: Optional[TextIO] = None, unit: str = "capture"):
        self.total, self.done = total, 0
        self.lines = total > 1  # one line per item when redirected (a total that moves: always)
        self.stream = stream if stream is not None else sys.stderr
        if isinstance(self.stream, PrintableStream):  # the bar's own \r and tqdm's cursor codes pass;
            self.stream = self.stream.stream  # the labels (file names) are escaped in step()
        isatty = getattr(self.stream, "isatty", None)
        self.live = total > 1 and bool(isatty and isatty())
        self._bar = None
        self._pending: dict[int, str] = {}  # done out of order, not yet listed (step's index)
        self._next = 0  # the first index not yet listed
        if self.live:
            try:
                from tqdm import tqdm

                self._bar = tqdm(total=total, file=self.stream, unit=unit, dynamic_ncols=True, leave=False, mininterval=0)
            except ImportError:
                self._bar = None

    def step(self, label: str, index: Optional[int] = None) -> None:
        """One item done. ``index`` (its place in the order given, 0-based): items finished out of
        order (worker processes) are listed one line each in that order, each once every item
        before it is done, so the lines of a redirected run do not depend on timing."""
        self.done += 1
        if index is not None and not self.live and self.total > 1:
            self._pending[index] = label
            while self._next in self._pending:
                self._next += 1
                self.stream.write(f"[{self._next}/{self.total}] {printable(self._pending.pop(self._next - 1))}\n")
            return
        label = printable(label)
        if self._bar is not None:
            self._bar.set_postfix_str(label[-50:], refresh=False)
            self._bar.update(1)
        elif self.live:
            bar = "#" * (20 * self.done // self.total)
            self.stream.write(f"\r[{bar:<20}] {self.done}/{self.total} {label[-50:]:<50}")
            self.stream.flush()
        elif self.lines:
            self.stream.write(f"[{self.done}/{self.total}] {label}\n")

    def retotal(self, total: int) -> None:
        """A new total (an estimate that moved: the cases a sweep's budget holds), never below ``done``."""
        self.total, self.lines = max(int(total), self.done, 1), True
        if self._bar is not None:
            self._bar.total = self.total

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        elif self.live:
            self.stream.write("\n")
