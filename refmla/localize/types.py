"""What localization found: typed, with one line of text for the table."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

STAGES = {
    "stage1": "stage 1 (split partials)",
    "stage1_lse": "stage 1 (split lse)",
    "stage2": "stage 2 (merge of correct partials)",
    "lse": "the final lse (the output is right)",
}


@dataclass
class Span:
    """Positions [start, end) of one request (its sequence order) that the evidence points at."""

    request: int
    start: int
    end: int
    how: str  # "removal restores" | "carries the error" | "split partial fails"
    pages: Optional[tuple[int, int]] = None  # first and last page of the request (page_size > 1)
    split: Optional[int] = None  # the split these positions belong to (stage 1)
    share: Optional[float] = None  # "carries the error": the fraction of the error its removal takes away
    evidence: Optional[tuple[int, int]] = None  # the narrowest [start, end) inside whose removal still restores

    def text(self) -> str:
        where = f"positions {self.start}..{self.end - 1}"
        if self.pages is not None:
            a, b = self.pages
            where += f" (page {a})" if a == b else f" (pages {a}-{b})"
        if self.split is not None:
            where += f" of split {self.split}"
        if self.how == "carries the error" and self.share is not None:
            return f"{where} carry {100 * self.share:.0f}% of the error"
        return f"{where}: {self.how}"

    def to_json(self) -> dict[str, Any]:
        d = {"request": self.request, "start": self.start, "end": self.end, "how": self.how}
        for k in ("pages", "split", "share", "evidence"):
            v = getattr(self, k)
            if v is not None:
                d[k] = list(v) if isinstance(v, tuple) else v
        return d


@dataclass
class Localization:
    """Where a failing backend goes wrong: rows, positions, stage; and what was tried."""

    requests: list[int]  # failing requests, worst first
    heads: dict[int, list[int]]  # request -> its failing heads (any part)
    stage: Optional[str] = None  # a key of STAGES, None when the backend has no split stages
    spans: list[Span] = field(default_factory=list)
    tried: list[str] = field(default_factory=list)  # what was searched, found or not
    cause: Optional[dict[str, Any]] = None  # a named cause of a part no hypothesis covers (lse_units)
    entries: list = field(default_factory=list)  # a sparse capture's top-k entries (refmla.localize.entries.EntrySpan)

    def text(self) -> str:
        """"request 1 heads 0-7, positions 640..703 (page 10): removal restores, stage 1 (split partials)"."""
        if not self.requests:
            return "localized: no failing row (" + "; ".join(self.tried) + ")"
        b = self.requests[0]
        parts = [f"request {b} heads {_ranges(self.heads.get(b, []))}"]
        if len(self.requests) > 1:
            parts[0] += f" (and request(s) {', '.join(map(str, self.requests[1:6]))})"
        parts += [s.text() for s in self.spans if s.request == b][:2]
        parts += [e.text() for e in self.entries if e.request == b][:2]
        if self.stage:
            parts.append(STAGES[self.stage])
        if self.cause is not None:
            units = self.cause["detail"]["units"]
            parts.append("the final lse in log2 units" if units == "log2" else "the final lse in ln units (log2 meant)")
        if len(parts) == 1 and self.tried:
            parts.append("no positions found (" + "; ".join(self.tried) + ")")
        return "localized: " + ", ".join(parts)

    def to_json(self) -> dict[str, Any]:
        return {"requests": list(self.requests), "heads": {str(b): h for b, h in self.heads.items()},
                "stage": self.stage, "spans": [s.to_json() for s in self.spans], "tried": list(self.tried),
                "cause": self.cause, **({"entries": [e.to_json() for e in self.entries]} if self.entries else {}),
                "text": self.text()}  # fmt: skip


def _ranges(xs: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2, 5"."""
    out, i = [], 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        out.append(str(xs[i]) if i == j else f"{xs[i]}-{xs[j]}")
        i = j + 1
    return ", ".join(out) or "-"
