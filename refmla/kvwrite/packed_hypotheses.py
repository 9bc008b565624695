"""Which simple mistake of a packed writer (DeepSeek-V4's UE8M0 pages, meta ``kv_layout``) explains
the token rows that differ from the documented ones, each checked bit for bit, tried in this order:

    kv_fp8_encoding_mismatch  the pages written in the other fp8 encoding (e4m3fn <-> e4m3fnuz: the tile
                              exponents from amax / 448 or / 240, the bytes in the other format;
                              refmla.kvwrite.encoding)

    kv_scale_not_applied      a quantizing writer stored the latent rounded without the tile scales
                              (the exponent bytes documented, or 127: scale 1)
    kv_ue8m0_exponent_off     some tiles' exponent bytes differ from the documented ones, their fp8
                              bytes either as documented or requantized at the stored exponent
    kv_tokens_not_written, kv_rope_stale  rows (or their rope bytes) left as they were (refmla.kvwrite.hypotheses)
    kv_rope_offset            the rope's 128 bytes at another byte offset of the token's data row
                              (or past it, into the next slot's row of the same page)
    kv_row_to_other_slot      a token's bytes stored at another kept slot (refmla.kvwrite.hypotheses)
    kv_neighbour_overwritten  a kept row the call did not write changed (refmla.kvwrite.hypotheses)

Each detail names the ``tokens``, their ``slots`` and ``pages``; a tile is ``[token, tile]``.
"""

from __future__ import annotations

from typing import Optional

import torch

from refmla.kvwrite import packed
from refmla.kvwrite.format import KvWriteCapture
from refmla.kvwrite.encoding import encoding_mismatch, packed_cast_overflow
from refmla.kvwrite.hypotheses import (Mismatch, explained, neighbour_overwritten, rope_stale, row_to_other_slot,
                                       stale_rows, tokens_not_written)
from refmla.results import Explanation


def _where(cap: KvWriteCapture, tokens: list[int]) -> dict:
    slots = [int(cap.slots[t]) for t in tokens]
    return {"tokens": tokens, "slots": slots, "pages": [s // cap.meta.page_size for s in slots]}


def _cuts(cap: KvWriteCapture) -> tuple[int, int, int]:
    """Where the nope, rope and exponent bytes end in a token row."""
    lay = packed.layout_of(cap.meta.kv_layout)
    return lay.d_nope, lay.data_bytes, lay.data_bytes + lay.num_tiles


def _after(cap: KvWriteCapture, t: int) -> torch.Tensor:
    return cap.rows_after[int(cap.positions()[t])]


def _scale_not_applied(cap: KvWriteCapture, mm: Mismatch) -> Optional[Explanation]:
    if cap.meta.packed_input != "latent" or not mm.tokens or mm.others:
        return None
    n, r, s = _cuts(cap)
    nope, _, _ = packed.sections(cap, divide=False)
    stored = set()
    for t in mm.tokens:
        row = _after(cap, t)
        if not torch.equal(row[:n], nope[t]) or not torch.equal(row[n:r], mm.rows[t, n:r]):
            return None
        if torch.equal(row[r:s], mm.rows[t, r:s]):
            stored.add("documented")
        elif bool((row[r:s] == 127).all()):
            stored.add("127 (scale 1)")
        else:
            return None
    return explained("kv_scale_not_applied", {**_where(cap, mm.tokens), "scale": "per-tile UE8M0",
                                              "exponent_bytes": "/".join(sorted(stored))})  # fmt: skip


def _exponent_off(cap: KvWriteCapture, mm: Mismatch) -> Optional[Explanation]:
    if not mm.tokens or mm.others:
        return None
    lay = packed.layout_of(cap.meta.kv_layout)
    n, r, s = _cuts(cap)
    tiles, documented, stored, values = [], [], [], set()
    for t in mm.tokens:
        row = _after(cap, t)
        if not torch.equal(row[n:r], mm.rows[t, n:r]):
            return None
        e_doc, e_got = mm.rows[t, r:s].long(), row[r:s].long()
        off = (e_doc != e_got).nonzero().flatten().tolist()
        if not off:
            return None
        for j in range(lay.num_tiles):
            cut = slice(j * lay.tile, (j + 1) * lay.tile)
            same = torch.equal(row[cut], mm.rows[t, cut])
            if j not in off and not same:
                return None
            if j not in off:
                continue
            if same:
                values.add("as documented")
                continue
            if cap.meta.packed_input != "latent":
                return None
            e = e_doc.clone()[None]
            e[0, j] = e_got[j]
            requant = packed.quantize_tiles(cap.latent[t : t + 1].float(), e, lay, cap.meta.kv_dtype)[0]
            if not torch.equal(row[cut], requant[cut]):
                return None
            values.add("requantized at the stored exponent")
        for j in off:
            tiles.append([t, j])
            documented.append(int(e_doc[j]))
            stored.append(int(e_got[j]))
    deltas = sorted({b - a for a, b in zip(documented, stored)})
    return explained("kv_ue8m0_exponent_off", {**_where(cap, mm.tokens), "tiles": tiles, "documented": documented,
                                               "stored": stored, "offset": deltas[0] if len(deltas) == 1 else deltas,
                                               "fp8_values": "; ".join(sorted(values))})  # fmt: skip


def _stream(cap: KvWriteCapture, t: int, data: int) -> torch.Tensor:
    """The token's data row, then the next slot's when it is kept and on the same page (contiguous)."""
    pos, slot, ps = int(cap.positions()[t]), int(cap.slots[t]), cap.meta.page_size
    row = cap.rows_after[pos, :data]
    nxt = pos + 1
    if nxt < cap.pool_slots.shape[0] and int(cap.pool_slots[nxt]) == slot + 1 and (slot + 1) % ps:
        return torch.cat([row, cap.rows_after[nxt, :data]])
    return row


def _rope_offset(cap: KvWriteCapture, mm: Mismatch) -> Optional[Explanation]:
    if not mm.tokens:
        return None
    n, r, s = _cuts(cap)
    width = r - n
    found = set()
    for t in mm.tokens:
        stream, want = _stream(cap, t, r), mm.rows[t, n:r]
        if not torch.equal(_after(cap, t)[r:s], mm.rows[t, r:s]):
            return None
        hits = [o for o in range(0, stream.shape[0] - width + 1, 2)
                if o != n and torch.equal(stream[o : o + width], want)]  # fmt: skip
        keep = [o for o in hits if _nope_kept(stream, mm.rows[t, :n], o, width)]
        if not keep:
            return None
        found.add(keep[0])
    if len(found) != 1:
        return None
    o = found.pop()
    rest = [int(cap.pool_slots[p]) for p in mm.others]
    return explained("kv_rope_offset", {"offset": o, "expected_offset": n, "unit": "bytes", **_where(cap, mm.tokens),
                                        "also_overwritten": rest})  # fmt: skip


def _nope_kept(stream: torch.Tensor, nope: torch.Tensor, o: int, width: int) -> bool:
    """The nope bytes outside the misplaced rope are the documented ones."""
    keep = torch.ones(nope.shape[0], dtype=torch.bool)
    keep[o : o + width] = False
    return torch.equal(stream[: nope.shape[0]][keep], nope[keep])


HYPOTHESES = (encoding_mismatch, packed_cast_overflow, _scale_not_applied, _exponent_off, tokens_not_written, rope_stale, _rope_offset,
              stale_rows, row_to_other_slot, neighbour_overwritten)  # fmt: skip


def explain_packed(cap: KvWriteCapture, mm: Mismatch) -> Optional[Explanation]:
    """The first hypothesis that reproduces every differing token row, or None."""
    for h in HYPOTHESES:
        e = h(cap, mm)
        if e is not None:
            if h in (row_to_other_slot, neighbour_overwritten):
                e.detail.setdefault("pages", [int(v) // cap.meta.page_size for v in e.detail["slots"]])
            return e
    return None


__all__ = ["HYPOTHESES", "explain_packed"]
