"""Whose KV a mismatching request received: when the decode rows of its first mismatching range are,
bit for bit, another request's prefill rows at the same positions, that request's rid (the
transfer wrote the wrong request's KV, or the decode side's slots belong to another request)."""

from __future__ import annotations

from typing import Optional

import torch

from refmla.capture import Capture
from refmla.diffkv import RequestDiff
from refmla.pool import rows_differ


def first_range(entry: RequestDiff) -> Optional[tuple[int, int]]:
    """[start, end) of the first mismatching transfer run, else of the first mismatching range."""
    run = entry.first_run
    if run is not None:
        return run.start, run.end
    mm = entry.mismatches
    return tuple(mm.ranges[0]) if mm is not None and mm.ranges else None


def foreign_source(entry: RequestDiff, prefill: list[Capture], decode: Capture) -> Optional[str]:
    """The rid whose prefill rows the decode side holds for ``entry``'s first mismatching range, or None."""
    span = first_range(entry)
    rids = decode.meta.rids
    if span is None or rids is None or entry.rid not in rids:
        return None
    a, b = span
    d = rids.index(entry.rid)
    d0 = int(decode.kv_indptr[d])
    rows_d = decode.kv_indices[d0 + a : d0 + b].long()  # [b - a]
    if bool((rows_d < 0).any()) or rows_d.numel() != b - a:
        return None
    for c in prefill:
        for j, rid in enumerate((c.meta.rids or [])[: c.batch_size]):
            if rid == entry.rid or int(c.seq_lens[j]) < b:
                continue
            p0 = int(c.kv_indptr[j])
            rows_p = c.kv_indices[p0 + a : p0 + b].long()
            if bool((rows_p < 0).any()):  # a sparse cache's positions it does not hold
                continue
            if not bool(rows_differ(c.kv_buffer, rows_p, decode.kv_buffer, rows_d).any()):
                return rid
    return None


__all__ = ["first_range", "foreign_source"]
