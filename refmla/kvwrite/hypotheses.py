"""Which simple writer mistake explains rows that differ from the documented ones (each checked
bit for bit, never within a tolerance), tried in this order:

    kv_fp8_encoding_mismatch fp8: the rows in another fp8 encoding than the pool's (refmla.kvwrite.encoding)
    kv_cast_overflow         fp8: torch's own cast past the range (NaN on e4m3fnuz), not saturation
    kv_scale_not_applied     fp8: the rows are the inputs rounded without dividing by the scale
    kv_scale_inverted        fp8: the inputs multiplied by the scale instead of divided
    kv_scale_other_value     fp8: divided by another scale (its ratio to the recorded one)
    kv_tokens_not_written    some tokens' rows (every token's: the call wrote elsewhere) left as they were
    kv_rope_stale            the latent part written, the rope part left as it was
    kv_rope_offset           the rope part stored at another column than after the latent
    kv_written_to_stale_rows two or more tokens' rows stored at kept rows none of the call's slots
                             name (another slot mapping: a stale one, shifted), their own slots as they
                             were (``written_to``: the rows; refmla.chain also finds them in a decode
                             capture of the step)
    kv_row_to_other_slot     a token's row stored at another kept slot (its neighbour, ...)
    kv_neighbour_overwritten a row the call did not write changed (next to the slots it wrote)

:func:`explain` returns the typed :class:`refmla.results.Explanation` (detail: the tokens, their
slots and what was found), or None when none of them reproduces every differing row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from refmla.kvwrite import encoding
from refmla.kvwrite.format import FP8, KvWriteCapture
from refmla.kvwrite.reference import Variant, same_bytes, written_rows
from refmla.results import Explanation


@dataclass
class Mismatch:
    """The differing rows of one writer call (indices into the kept rows / the tokens)."""

    rows: torch.Tensor  # [T, D] documented token rows
    tokens: list[int]  # tokens whose own slot does not hold their documented row
    others: list[int]  # kept rows the call did not write that changed (positions in pool_slots)
    width: Optional[int] = None  # the leading bytes / columns a writer writes (packed: all but the pad)

    def slots(self, cap: KvWriteCapture) -> list[int]:
        return [int(cap.slots[t]) for t in self.tokens]


def _explained(hypothesis: str, detail: dict) -> Explanation:
    return Explanation(hypothesis=hypothesis, request=None, detail=detail, max_abs_err=0.0, residual_ratio=0.0)


def _scale(cap: KvWriteCapture, mm: Mismatch) -> Optional[Explanation]:
    if cap.meta.kv_dtype not in FP8 or cap.scale_value() == 1.0 or not mm.tokens or mm.others:
        return None
    pos = cap.positions()[mm.tokens]
    for how, name in (("none", "kv_scale_not_applied"), ("multiply", "kv_scale_inverted")):
        rows = written_rows(cap, Variant(scale=how))[mm.tokens]
        if bool(same_bytes(rows, cap.rows_after[pos]).all()):
            return _explained(name, {"scale": cap.scale_value(), "tokens": mm.tokens, "slots": mm.slots(cap)})
    return None


def parts(cap: KvWriteCapture) -> tuple[tuple[int, int], tuple[int, int]]:
    """The (start, end) columns of a token row's latent part (packed: its nope bytes and exponents
    together) and of its rope part."""
    if cap.meta.packed:
        from refmla.kvwrite import packed

        lay = packed.layout_of(cap.meta.kv_layout)
        return (0, lay.d_nope), (lay.d_nope, lay.data_bytes)
    L = cap.meta.kv_lora_rank
    return (0, L), (L, cap.meta.head_dim)


def _cols(rows: torch.Tensor, span: tuple[int, int]) -> torch.Tensor:
    return rows[:, span[0] : span[1]].contiguous()


def _kept(cap: KvWriteCapture, mm: Mismatch, span: tuple[int, int]) -> torch.Tensor:
    """[t] bool: each differing token's columns ``span`` hold what they held before the call."""
    pos = cap.positions()[mm.tokens]
    return same_bytes(_cols(cap.rows_after[pos], span), _cols(cap.rows_before[pos], span))


def _not_written(cap: KvWriteCapture, mm: Mismatch) -> Optional[Explanation]:
    if not mm.tokens or mm.others:
        return None
    w = mm.width or cap.rows_after.shape[1]
    if not bool(_kept(cap, mm, (0, w)).all()):
        return None
    every = len(mm.tokens) == cap.tokens
    return _explained("kv_tokens_not_written", {"tokens": mm.tokens, "slots": mm.slots(cap), "every_token": every,
                      "why": "the call wrote none of its rows here: another layer's buffer, or a write that never ran"
                      if every else "these tokens' rows were skipped (a slot mapping that dropped them)"})  # fmt: skip


def _rope_stale(cap: KvWriteCapture, mm: Mismatch) -> Optional[Explanation]:
    lat, rope = parts(cap)
    if rope[1] <= rope[0] or not mm.tokens or mm.others:
        return None
    pos = cap.positions()[mm.tokens]
    w = mm.width or cap.rows_after.shape[1]
    rest = [(0, lat[1]), (rope[1], w)] if rope[1] < w else [(0, lat[1])]
    ok = _kept(cap, mm, rope) & ~same_bytes(_cols(mm.rows[mm.tokens], rope), _cols(cap.rows_before[pos], rope))
    for span in rest:
        ok &= same_bytes(_cols(cap.rows_after[pos], span), _cols(mm.rows[mm.tokens], span))
    if not bool(ok.all()):
        return None
    return _explained("kv_rope_stale", {"tokens": mm.tokens, "slots": mm.slots(cap), "rope_columns": list(rope)})


def _rope_offset(cap: KvWriteCapture, mm: Mismatch) -> Optional[Explanation]:
    L, R = cap.meta.kv_lora_rank, cap.meta.qk_rope_head_dim
    if not R or not mm.tokens or mm.others:
        return None
    found = set()
    for t in mm.tokens:
        row = cap.rows_after[int(cap.positions()[t])]
        want = mm.rows[t, L:]
        hits = [o for o in range(0, L + 1) if o != L and bool(same_bytes(row[None, o : o + R], want[None]).all())]
        if not hits:
            return None
        found.add(hits[0])
    if len(found) != 1:
        return None
    return _explained("kv_rope_offset", {"offset": found.pop(), "expected_offset": L, "tokens": mm.tokens,
                                         "slots": mm.slots(cap)})  # fmt: skip


def _other_slot(cap: KvWriteCapture, mm: Mismatch) -> Optional[Explanation]:
    if not mm.tokens:
        return None
    moved = []
    w = mm.width or cap.rows_after.shape[1]
    for t in mm.tokens:
        hit = same_bytes(cap.rows_after[:, :w], mm.rows[t, :w][None].expand(cap.rows_after.shape[0], w))  # [N]
        hit[cap.positions()[t]] = False
        if not bool(hit.any()):
            return None
        moved.append(int(cap.pool_slots[int(hit.nonzero()[0])]))
    landed = {int(cap.pool_slots.tolist().index(s)) for s in moved}
    rest = [int(cap.pool_slots[p]) for p in mm.others if p not in landed]
    return _explained("kv_row_to_other_slot", {"tokens": mm.tokens, "slots": mm.slots(cap), "written_to": moved,
                                               "also_overwritten": rest})  # fmt: skip


def _stale_rows(cap: KvWriteCapture, mm: Mismatch) -> Optional[Explanation]:
    if len(mm.tokens) < 2 or not mm.others:
        return None
    w = mm.width or cap.rows_after.shape[1]
    if not bool(_kept(cap, mm, (0, w)).all()):  # each token's own slot holds what it held
        return None
    own = set(cap.slots.tolist())
    landed = []
    for t in mm.tokens:
        hit = same_bytes(cap.rows_after[:, :w], mm.rows[t, :w][None].expand(cap.rows_after.shape[0], w))  # [N]
        at = [int(cap.pool_slots[p]) for p in hit.nonzero().flatten().tolist() if int(cap.pool_slots[p]) not in own]
        if not at:
            return None
        landed.append(at[0])
    changed = {int(cap.pool_slots[p]) for p in mm.others}
    if not set(landed) <= changed:
        return None
    detail = {"tokens": mm.tokens, "slots": mm.slots(cap), "written_to": landed, "every_token": len(mm.tokens) == cap.tokens}
    shift = {w_ - s for w_, s in zip(landed, detail["slots"])}
    if len(shift) == 1:
        detail["slot_offset"] = shift.pop()
    return _explained("kv_written_to_stale_rows", detail)


def _neighbours(cap: KvWriteCapture, mm: Mismatch) -> Optional[Explanation]:
    if mm.tokens or not mm.others:
        return None
    slots = [int(cap.pool_slots[p]) for p in mm.others]
    written = sorted(set(cap.slots.tolist()))
    next_to = [min(written, key=lambda w: abs(w - s)) for s in slots]
    return _explained("kv_neighbour_overwritten", {"slots": slots, "next_to_written_slot": next_to})


HYPOTHESES = (encoding.encoding_mismatch, encoding.cast_overflow, _scale, encoding.scale_other_value, _not_written,
              _rope_stale, _rope_offset, _stale_rows, _other_slot, _neighbours)  # fmt: skip
# the mechanisms every layout shares (refmla.kvwrite.packed_hypotheses reuses them)
row_to_other_slot, neighbour_overwritten, explained = _other_slot, _neighbours, _explained
tokens_not_written, rope_stale, stale_rows = _not_written, _rope_stale, _stale_rows


def explain(cap: KvWriteCapture, mm: Mismatch) -> Optional[Explanation]:
    """The first hypothesis that reproduces every differing row, or None."""
    for h in HYPOTHESES:
        e = h(cap, mm)
        if e is not None:
            return e
    return None


__all__ = ["HYPOTHESES", "Mismatch", "explain", "explained", "neighbour_overwritten", "parts", "rope_stale",
           "row_to_other_slot", "stale_rows", "tokens_not_written"]  # fmt: skip
