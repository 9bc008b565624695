"""offset_overflow {"first_slot", "position", "offset", "reads", "wrapped_positions"}: a 32-bit KV row
offset wrapped (aiter #5765, #2768; Triton `kv_loc * stride` in int32), per request.

A kernel addresses pool row ``slot`` at ``slot * D`` elements or ``slot * D * itemsize`` bytes
(D = 576). Computed in 32 bits that wraps, exactly, past a slot threshold:

    uint32 bytes     slot * D * itemsize >= 2^32   reads the bytes at (slot * D * itemsize) mod 2^32
                                                    from the pool's base: another row, or two rows'
                                                    halves when 2^32 is not a multiple of the row
    int32 elements   slot * D >= 2^31              negative offset: before the pool (a buffer load
    int32 bytes      slot * D * itemsize >= 2^31   returns 0 there)

Slots are physical (``orig_kv_indices``; ``kv_indices`` when the capture has none), so a capture
needs no 4 GiB pool: the wrap is computed from the slot numbers. What the wrapped offset reads is
recomputed only from what the capture holds: the row(s) at the wrapped address when it holds
their physical slots (attended by some request, or an uncompacted pool), else zeros (a
never-written slot of a zero-initialized pool, or a buffer load out of range). A wrapped read of
rows the capture does not hold, and that were not zero, cannot be confirmed: the family says
nothing then. Tried right after seq_len_off_by: it has no free parameter and costs nothing when
no slot is past a threshold (every capture of a pool under 2^31 / 576 = 3.7M slots).
"""

from __future__ import annotations

from typing import Iterator, Optional

import torch

from refmla.hypotheses.drivers import per_request, rescore
from refmla.hypotheses.search import Candidate, Search, bits
from refmla.results import Explanation

NAME = "offset_overflow"
ZEROS = "zeros"


def search(s: Search) -> Optional[Explanation]:
    phys = physical_slots(s)
    rb = s.cap.kv_buffer.shape[-1] * s.cap.kv_buffer.element_size()
    if phys is None or not bool((phys * rb >= 2**31).any()):
        return None  # no slot is past any threshold
    return per_request(s, NAME, find_overflow)


def physical_slots(s: Search) -> Optional[torch.Tensor]:
    o = s.cap.orig_kv_indices
    return (o if o is not None else s.cap.kv_indices).long() if len(s.cap.kv_indices) else None


def models(s: Search) -> list[tuple[str, int, bool]]:
    """(how the offset is computed, the first slot that wraps, whether it reads inside the pool)."""
    D, item = s.cap.kv_buffer.shape[-1], s.cap.kv_buffer.element_size()
    rb = D * item
    return [
        (f"slot * {D} * {item} bytes in uint32", -(-(2**32) // rb), True),
        (f"slot * {D} elements in int32", -(-(2**31) // D), False),
        (f"slot * {D} * {item} bytes in int32", -(-(2**31) // rb), False),
    ]


def find_overflow(s: Search, b: int) -> Iterator[Candidate]:
    r = s.req(b)
    lo = int(s.att.indptr[b])  # where request b's positions start in kv_indices
    phys = physical_slots(s)[lo : lo + r.L]  # [L] physical slot of each position
    seen: set = set()
    for offset, first, inside in models(s):
        wrapped = phys >= first  # [L]
        if not bool(wrapped.any()):
            continue
        reads = [("row", wrapped_rows(s, phys[wrapped])), (ZEROS, None)] if inside else [(ZEROS, None)]
        for how, rows in reads:
            key = (tuple(torch.nonzero(wrapped).flatten().tolist()), how)
            if key in seen or (how == "row" and rows is None):
                continue
            seen.add(key)
            yield candidate(s, b, phys, wrapped, offset, first, rows)


def candidate(s: Search, b: int, phys: torch.Tensor, wrapped: torch.Tensor, offset: str, first: int,
              rows: Optional[torch.Tensor]) -> Candidate:  # fmt: skip
    """Request b with its wrapped positions reading ``rows`` [n, D] (stored dtype) or zeros."""
    r = s.req(b)
    kvs = s.cap.kv_buffer[:, 0].index_select(0, r.pool_rows).clone()  # [L, D] stored dtype
    if rows is None:
        bits(kvs)[wrapped] = 0
    else:
        bits(kvs)[wrapped] = bits(rows)
    exp, ctl = s.attend_kv(b, kvs.double(), kvs, r.vis)
    p = int(torch.nonzero(wrapped)[0])
    slot = int(phys[p])
    reads = "zeros (a never-written slot, or a buffer load out of range)"
    if rows is not None:
        rb = s.cap.kv_buffer.shape[-1] * s.cap.kv_buffer.element_size()
        off = slot * rb % 2**32
        reads = f"slot {off // rb}" if off % rb == 0 else f"slots {off // rb} (from byte {off % rb}) and {off // rb + 1}"
    detail = {"first_slot": slot, "position": p, "offset": offset, "reads": reads}
    extra = {"wrapped_positions": int(wrapped.sum()), "first_wrapping_slot": first}
    return Candidate(detail, exp, ctl, rescore(s, b, exp), extra=extra)


def wrapped_rows(s: Search, slots: torch.Tensor) -> Optional[torch.Tensor]:
    """The rows a uint32 byte offset reads for ``slots`` [n], assembled byte by byte from the pool's
    rows at the wrapped address: [n, D] in the stored dtype, or None when the capture lacks one."""
    kvb = s.cap.kv_buffer[:, 0]  # [N, D]
    u8 = kvb.view(torch.uint8)  # [N, rb]
    rb = u8.shape[-1]
    off = slots * rb % 2**32  # [n] byte offset actually read
    r0, sh = off // rb, off % rb
    need = torch.cat([r0, r0[sh > 0] + 1])
    where = slot_rows(s)
    if where is None:
        return None
    pos = torch.searchsorted(where[0], need).clamp(max=len(where[0]) - 1)
    if not bool((where[0][pos] == need).all()):
        return None
    row_of = dict(zip(need.tolist(), where[1][pos].tolist()))
    out = torch.empty(len(slots), rb, dtype=torch.uint8)
    for i, (a, k) in enumerate(zip(r0.tolist(), sh.tolist())):
        out[i, : rb - k] = u8[row_of[a], k:]
        if k:
            out[i, rb - k :] = u8[row_of[a + 1], :k]
    return out.view(kvb.dtype)


def slot_rows(s: Search) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """(physical slots, sorted; the pool row holding each): what the capture holds, by slot."""
    cap = s.cap
    o = cap.orig_kv_indices
    if o is None or torch.equal(o.long(), cap.kv_indices.long()):
        n = cap.kv_buffer.shape[0]
        return torch.arange(n), torch.arange(n)
    phys, order = torch.sort(o.long())
    return phys, cap.kv_indices.long()[order]
