"""Whom a failing backend blames: the rows that failed in the part that failed.

A backend fails on its ``out``, its ``lse`` or its split partials (``BackendEntry.failed_parts``).
Its failing requests are the union over the failing parts, each part's own rows; its worst row is
the worst of ``out`` when ``out`` failed, else the worst of the first failing part. Where a part
failed on something no row shows (a cosine over the whole tensor), its worst
row stands for it; a row with a misplaced NaN / Inf is a failing row. Used by the text table's worst column and by ``refmla disagg`` for the
request of each row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from refmla.compare import Worst
from refmla.results import BackendEntry


@dataclass(frozen=True)
class Blame:
    """The worst failing row of a backend, in the part where it failed."""

    part: str  # "out" | "lse" | "attn_logits"
    request: Optional[int]
    head: Optional[int]
    split: Optional[int] = None  # attn_logits: the split of that request

    def text(self) -> str:
        """"req 2 head 0" for out, "req 2 head 0 (lse)", "req 2 head 0 split 3 (partials)"."""
        if self.request is None:
            return "-"
        where = f"req {self.request} head {self.head}" + (f" split {self.split}" if self.split is not None else "")
        return where + {"out": "", "lse": " (lse)", "attn_logits": " (partials)"}[self.part]


def _out_requests(entry: BackendEntry, request_of_row: Optional[Sequence[int]]) -> set[int]:
    cmp = entry.comparison
    if cmp is None or cmp.row_err is None or cmp.row_tol is None:
        return set()
    bad = ~(cmp.row_err <= cmp.row_tol).all(dim=1)  # [R], NaN counts as over
    if cmp.row_nonfinite is not None:  # a misplaced NaN / Inf fails its row whatever its finite error
        bad |= cmp.row_nonfinite.any(dim=1)
    rows = [int(r) for r in bad.nonzero().flatten()]
    if not rows and cmp.worst is not None and cmp.worst.request is not None:  # failed on no single row
        return {int(cmp.worst.request)}
    return {int(request_of_row[r]) if request_of_row is not None else r for r in rows}


def _part_requests(check) -> set[int]:
    if check is None or check.status != "fail":
        return set()
    if check.failed_requests:
        return set(check.failed_requests)
    req = check.worst.request if check.worst is not None else None
    return {int(req)} if req is not None else set()


def failing_requests(entry: BackendEntry, request_of_row: Optional[Sequence[int]] = None) -> dict[str, set[int]]:
    """part -> the requests with a failing row in it, for each part that failed (decode: row b is
    request b; else ``request_of_row`` maps ``out`` rows to requests)."""
    if entry.status != "fail":
        return {}
    parts = entry.failed_parts or ["out"]
    got = {"out": _out_requests(entry, request_of_row) if "out" in parts else set(),
           "lse": _part_requests(entry.lse) if "lse" in parts else set(),
           "attn_logits": _part_requests(entry.splits) if "attn_logits" in parts else set()}  # fmt: skip
    return {p: r for p, r in got.items() if p in parts}


def blames_request(entry: BackendEntry, b: int) -> bool:
    """A failing backend fails request ``b`` when some failing part has a failing row of ``b``."""
    return any(b in reqs for reqs in failing_requests(entry).values())


def worst_blame(entry: BackendEntry) -> Optional[Blame]:
    """The worst row of the first failing part (out first), None when the backend did not fail."""
    if entry.status != "fail":
        return None
    parts = entry.failed_parts or ["out"]
    if "out" in parts:
        w = entry.worst or Worst()
        return Blame("out", w.request, w.head)
    if "lse" in parts and entry.lse is not None:
        w = entry.lse.worst or Worst()
        return Blame("lse", w.request if "request" in w.keys else w.row, w.head)
    w = (entry.splits.worst if entry.splits is not None else None) or Worst()
    return Blame("attn_logits", w.request, w.head, w.split)
