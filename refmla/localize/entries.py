"""A sparse decode capture's failing request localized to its entries (issue 28): for its first
failing query row, the top-k entry (which cache, its position in that cache's index list, the slot)
whose removal brings the row's output back, else the whole compressed (or main) cache whose removal
does, else the entry whose removal takes away the largest share of the error ("carries the error").

Every entry's removal is ranked at once by a rank-one update of the row's softmax (numerator and
denominator less entry j's term), in chunks of entries; the best is recomputed exactly and judged
by the one comparator at the row's own noise floor, as every candidate is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from refmla.compare import Tolerance
from refmla.sparse.format import SparseCapture
from refmla.sparse.misplaced import entry_position, judge_row_variant, one_entry_errors
from refmla.sparse.reference import SparseOutput, gather_keys
from refmla.sparse.rows import SparseRows

CACHES = ("main", "extra")
MAX_REQUESTS = 4  # failing requests localized to entries, worst first (the dense localization's count)


@dataclass
class EntrySpan:
    """What in request ``request``'s query row ``row`` (b * S + s) the evidence points at."""

    request: int
    row: int
    cache: str  # "main" | "extra" (the compressed cache)
    how: str  # "removal restores" | "carries the error"
    entry: Optional[int] = None  # its position in that cache's index list; None: the whole cache
    slot: Optional[int] = None  # the token it names in that cache
    share: Optional[float] = None  # "carries the error": the fraction of the error its removal takes away

    def text(self) -> str:
        where = (f"the {'compressed' if self.cache == 'extra' else 'main'} cache's entries" if self.entry is None
                 else f"{self.cache} entry {self.entry} (slot {self.slot})")  # fmt: skip
        if self.how == "carries the error" and self.share is not None:
            return f"{where} carries {100 * self.share:.0f}% of the error"
        return f"{where}: {self.how}"

    def to_json(self) -> dict[str, Any]:
        d = {"request": self.request, "row": self.row, "cache": self.cache, "how": self.how}
        d.update({k: v for k in ("entry", "slot", "share") if (v := getattr(self, k)) is not None})
        return d


def _restores(cap, out, ref, ctrl, tol, r: int, q, keys, valid) -> bool:
    """Whether row r's output with only ``valid`` entries read passes at the row's noise floor."""
    c = judge_row_variant("localize", cap, out, ref, ctrl, tol, r, q, keys, valid)
    return c.row_failed is None or not bool(c.row_failed[r].any())


def entry_spans(cap: SparseCapture, rows: SparseRows, out: torch.Tensor, ref: SparseOutput, ctrl: SparseOutput,
                tol: Tolerance, failing: dict[int, list[int]]) -> list[EntrySpan]:  # fmt: skip
    """One EntrySpan per failing request (``failing``: request -> its failing query rows, worst
    request first), at most MAX_REQUESTS; a request with nothing found has none."""
    if cap.inv_rope_freqs is not None:  # the output is rotated after the sum: removal is not rank-one
        return []
    B, S, H, D = cap.q.shape
    Dv = cap.meta.head_dim_v
    found = []
    for b, bad_rows in list(failing.items())[:MAX_REQUESTS]:
        r = bad_rows[0]
        part = rows.part(slice(r, r + 1))
        valid, tokens, pools = part.valid[0], part.token[0], part.pool_id[0]  # [W]
        if not bool(valid.any()):
            continue
        keys = gather_keys(cap, part)[0]  # [W, D]
        q = cap.q.reshape(B * S, H, D)[r].double()  # [H, D]
        want = out.double().reshape(B * S, H, Dv)[r]  # [H, Dv]
        err = one_entry_errors(cap, q, keys, valid, want).masked_fill(~valid, float("inf"))  # [W] entry j removed
        j = int(err.argmin())
        span = None
        if _restores(cap, out, ref, ctrl, tol, r, q, keys, valid & (torch.arange(valid.shape[0]) != j)):
            span = _entry(cap, b, r, j, tokens, pools, valid, "removal restores")
        for pool in (1, 0) if span is None and bool(((pools == 1) & valid).any()) else ():
            if _restores(cap, out, ref, ctrl, tol, r, q, keys, valid & (pools != pool)):
                span = EntrySpan(b, r, CACHES[pool], "removal restores")
                break
        if span is None:
            base = float((ref.out.reshape(B * S, H, Dv)[r] - want).abs().nan_to_num(float("inf")).amax())
            share = 1.0 - float(err[j]) / base if base > 0 and base != float("inf") else 0.0
            if share > 0.5:
                span = _entry(cap, b, r, j, tokens, pools, valid, "carries the error", round(share, 3))
        if span is not None:
            found.append(span)
    return found


def _entry(cap, b: int, r: int, j: int, tokens, pools, valid, how: str, share=None) -> EntrySpan:
    return EntrySpan(b, r, CACHES[int(pools[j])], how, entry=entry_position(cap, r, j, pools, valid),
                     slot=int(tokens[j]), share=share)


__all__ = ["EntrySpan", "entry_spans"]
