"""Which requests of the prefill capture(s) and the decode capture are the same, and which prefill
capture supplies each position of a request.

    pair requests        by rid (meta ``rids``) when every capture has them, else by order
    owner of position j  the prefill capture whose new tokens include j (chunked prefill: each
                         chunk's extend capture covers the whole sequence after its write), else
                         the last capture that covers j
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Optional

import torch

from refmla.capture import Capture
from refmla.diffkv.result import Label


@dataclass
class Source:
    """One prefill capture's view of one request."""

    cap: int  # index into the prefill captures
    b: int  # request index in that capture
    length: int  # positions it holds (its seq_len)
    new: tuple[int, int]  # [lo, hi) positions it wrote (extend: its new tokens; decode: the last one)

    @classmethod
    def of(cls, ci: int, cap: Capture, b: int) -> "Source":
        L = int(cap.seq_lens[b])
        if cap.is_decode:
            return cls(ci, b, L, (max(L - 1, 0), L))
        return cls(ci, b, L, (L - int(cap.qo_indptr[b + 1] - cap.qo_indptr[b]), L))


@dataclass
class PairedRequest:
    """One request as both sides hold it: its decode index (None: prefill side only) and its
    prefill sources (none: decode side only)."""

    label: Label  # rid, or the index when pairing by order
    rid: Optional[str]
    decode_b: Optional[int]
    sources: list[Source] = field(default_factory=list)

    @property
    def paired(self) -> bool:
        return self.decode_b is not None and bool(self.sources)

    @cached_property
    def owner(self) -> torch.Tensor:
        """owner [Lmax]: which source supplies position j (index into sources)."""
        Lmax = max(s.length for s in self.sources)
        owner = torch.full((Lmax,), -1, dtype=torch.int64)
        for i, s in enumerate(self.sources):  # the last capture that covers j ...
            owner[: s.length] = i
        for i, s in enumerate(self.sources):  # ... unless one wrote j (the last one that did)
            lo, hi = s.new
            owner[lo:hi] = i
        return owner

    def prefill_rows(self, prefill: list[Capture], i: int, js: torch.Tensor, physical: bool = False) -> torch.Tensor:
        """Pool rows (or physical slots) of positions ``js`` in source ``i``'s capture, int64."""
        s = self.sources[i]
        c = prefill[s.cap]
        idx = c.orig_kv_indices if physical else c.kv_indices
        return idx[int(c.kv_indptr[s.b]) + js].long()

    def decode_at(self, decode: Capture, j: int) -> int:
        """Offset into the decode capture's kv_indices of position ``j``."""
        return int(decode.kv_indptr[self.decode_b]) + j


@dataclass
class Pairing:
    by: str  # "rid" | "order"
    requests: list[PairedRequest]  # in decode order, then prefill-only ones
    notes: list[str]

    @property
    def paired(self) -> list[PairedRequest]:
        return [r for r in self.requests if r.paired]


def pair_requests(prefill: list[Capture], decode: Capture) -> Pairing:
    """Pair by rid when every capture has ``rids``, else by order (with a note)."""
    if decode.meta.rids is not None and all(c.meta.rids is not None for c in prefill):
        return _pair_by_rid(prefill, decode)
    return _pair_by_order(prefill, decode)


def _pair_by_rid(prefill: list[Capture], decode: Capture) -> Pairing:
    notes: list[str] = []
    reqs: dict[Label, PairedRequest] = {}
    for b, rid in enumerate(decode.meta.rids[: decode.batch_size]):
        if rid in reqs:
            notes.append(f"decode capture lists rid {rid} twice; request {b} ignored")
            continue
        reqs[rid] = PairedRequest(rid, rid, b)
    for ci, c in enumerate(prefill):
        seen = set()
        for b, rid in enumerate(c.meta.rids[: c.batch_size]):
            if rid in seen:
                notes.append(f"{c.path} lists rid {rid} twice; request {b} ignored")
                continue
            seen.add(rid)
            reqs.setdefault(rid, PairedRequest(rid, rid, None)).sources.append(Source.of(ci, c, b))
    return Pairing("rid", list(reqs.values()), notes)


def _pair_by_order(prefill: list[Capture], decode: Capture) -> Pairing:
    missing = [c.path for c in [*prefill, decode] if c.meta.rids is None]
    notes = [f"paired by order: no rids in {', '.join(missing)}"]
    sizes = {c.path: c.batch_size for c in [*prefill, decode]}
    if len(set(sizes.values())) > 1:
        notes.append("batch sizes differ (" + ", ".join(f"{p}: {n}" for p, n in sizes.items())
                     + "); pairing by order is a guess")  # fmt: skip
    reqs = []
    for b in range(max(sizes.values())):
        rid = decode.meta.rids[b] if decode.meta.rids is not None and b < decode.batch_size else None
        r = PairedRequest(b, rid, b if b < decode.batch_size else None)
        r.sources = [Source.of(ci, c, b) for ci, c in enumerate(prefill) if b < c.batch_size]
        reqs.append(r)
    return Pairing("order", reqs, notes)
