"""Where a mismatched decode row's bytes come from: every row the prefill captures' requests
hold is hashed by its bytes (two independent 64-bit hashes of its words), and each mismatched
decode row of a request is looked up. Consecutive mismatched positions whose rows come from one
prefill request at one constant shift form a :class:`Source`:

    "decode page 8 of rid1 holds prefill rid3's page 4"          (another request's page)
    "pages 8-10 hold pages 9-11 (one page ahead)"                (the same request, k pages off)
    "page 3 holds page 2 (one page behind); prefill page 2 written twice (also at decode page 2)"
                                                                 (a prefill page found at two decode
                                                                 pages: :func:`mark_twice`)

All-zero rows (not landed) are never looked up: every zero row matches every other one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from refmla.capture import Capture
from refmla.pool import row_words

MAX_SOURCES = 16  # sources listed per request


@dataclass
class Source:
    """Decode positions [start, end) of a request hold the prefill rows of ``rid``'s positions
    [source_start, source_start + end - start)."""

    start: int
    end: int
    rid: Optional[str]  # the prefill request they belong to (its rid, or "#b of capture c")
    source_start: int
    same_request: bool
    page_size: int = 1
    also_at: Optional[int] = None  # the same prefill rows also found at decode positions [also_at, +n)

    @property
    def shift(self) -> int:
        """Source position - decode position."""
        return self.source_start - self.start

    def _pages(self, a: int, n: int) -> str:
        P = self.page_size
        first, last = a // P, (a + n - 1) // P
        word = "page" if P > 1 else "position"
        return f"{word} {first}" if first == last else f"{word}s {first}-{last}"

    def text(self, here: Optional[str] = None) -> str:
        n, P = self.end - self.start, self.page_size
        mine, theirs = self._pages(self.start, n), self._pages(self.source_start, n)
        if self.same_request:
            k = self.shift // P if P > 1 and self.shift % P == 0 else None
            unit = "page" if k is not None else "position"
            k = k if k is not None else self.shift
            ahead = f"{_count(abs(k))} {unit}{'s' if abs(k) != 1 else ''} {'ahead' if k > 0 else 'behind'}"
            line = f"{mine} hold{'s' if n <= P else ''} {theirs} ({ahead})"
        else:
            line = f"decode {mine} of {here or 'this request'} hold{'s' if n <= P else ''} prefill {self.rid}'s {theirs}"
        if self.also_at is not None:
            line += f"; prefill {theirs} written twice (also at decode {self._pages(self.also_at, n)})"
        return line

    def to_json(self) -> dict:
        return {"start": self.start, "end": self.end, "source_rid": self.rid, "source_start": self.source_start,
                "offset": self.shift, "same_request": self.same_request, "also_at": self.also_at,
                "text": self.text()}  # fmt: skip


def _count(k: int) -> str:
    return {1: "one", 2: "two", 3: "three"}.get(k, str(k))


class RowIndex:
    """Every prefill request's rows by the hash of their bytes: hash -> (rid, position)."""

    def __init__(self, prefill: list[Capture]):
        self.where: dict[tuple[int, int], tuple[str, int]] = {}
        self._mult: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for c, cap in enumerate(prefill):
            words = row_words(cap.kv_buffer)  # [N, W]
            for b in range(cap.batch_size):
                rows = cap.kv_indices[int(cap.kv_indptr[b]) : int(cap.kv_indptr[b + 1])].long()
                rid = cap.rid(b) or f"#{b} of prefill capture {c}"
                js = torch.nonzero(rows >= 0).flatten()  # a sparse cache's positions not held have no row
                for j, h in zip(js.tolist(), self.hashes(words, rows[js])):
                    self.where.setdefault(h, (rid, j))

    def hashes(self, words: torch.Tensor, rows: torch.Tensor) -> list[Optional[tuple[int, int]]]:
        """Per row: (h1, h2), or None for an all-zero row."""
        W = words.shape[1]
        if W not in self._mult:
            g = torch.Generator().manual_seed(W)
            self._mult[W] = tuple(torch.randint(1, 2**62, (W,), generator=g) * 2 + 1 for _ in range(2))  # odd
        w = words.index_select(0, rows).long()  # [n, W]
        h1, h2 = ((w * m).sum(1) for m in self._mult[W])  # int64, wrapping
        zero = (w == 0).all(1)
        return [None if bool(z) else (int(a), int(b)) for a, b, z in zip(h1, h2, zero)]


def sources_of(index: RowIndex, decode: Capture, rows: torch.Tensor, pos: torch.Tensor, rid: Optional[str]) -> list[Source]:
    """The Sources of mismatched positions ``pos`` (sorted) whose decode rows are ``rows``."""
    found = [index.where.get(h) if h is not None else None for h in index.hashes(row_words(decode.kv_buffer), rows)]
    out: list[Source] = []
    P = decode.meta.page_size
    for j, hit in zip(pos.tolist(), found):
        if hit is None:
            continue
        src_rid, p = hit
        last = out[-1] if out else None
        if last is not None and last.end == j and last.rid == src_rid and p - j == last.shift:
            last.end += 1
        elif len(out) < MAX_SOURCES:
            out.append(Source(j, j + 1, src_rid, p, same_request=src_rid == rid, page_size=P))
    return mark_twice(out, set(pos.tolist()))


def mark_twice(sources: list[Source], mismatched: set[int]) -> list[Source]:
    """Set ``also_at`` where one prefill run is found at two decode places: a run of the request's
    own rows whose source positions all match (the rows sit at their own place too), or two runs
    holding the same prefill rows."""
    for src in sources:
        n = src.end - src.start
        if src.same_request and not mismatched & set(range(src.source_start, src.source_start + n)):
            src.also_at = src.source_start
    for i, a in enumerate(sources):
        for b in sources[i + 1 :]:
            if (a.rid, a.source_start, a.end - a.start) == (b.rid, b.source_start, b.end - b.start):
                a.also_at, b.also_at = b.start, a.start
    return sources
