"""The bytes between a KV writer and its reader: which fp8 encoding the rows are in, how the cast
met the format's range, which scale divided them. Each hypothesis re-runs the writer reference
(refmla.kvwrite.reference, or the packed rule of refmla.kvwrite.packed) the other way and compares
the rows bit for bit, never within a tolerance:

    kv_fp8_encoding_mismatch  the rows are the documented writer's in another fp8 encoding: written
                              e4m3fn, e4m3fnuz or e5m2, read as the pool's (meta kv_dtype). The same
                              byte is worth half in e4m3fnuz what it is in e4m3fn (a packed V4 tile:
                              its exponent from amax / 448 or amax / 240 as well)
    kv_cast_overflow          the rows are torch's own cast of the scaled row, x.to(fp8) without
                              saturation: past the range torch's e4m3fnuz cast gives NaN (torch 2.13:
                              from 248 up) where e4m3fn's saturates; the scale is too small. A V4
                              page (quantizing writer): its tiles scaled for the other e4m3's range
                              (amax / 448 into an e4m3fnuz pool: up to 448 where 240 is the most), the
                              cast saturating (SGLang's store clamps to 448, then casts) or torch's
    kv_scale_format           fp8: divided by the recorded fp32 scale read as bf16 or UE8M0
                              (refmla.scales.read_as: ``read``, ``how``, ``value_read``)
    kv_scale_other_value      fp8: the rows are the inputs divided by another scale (``ratio`` times
                              the one recorded; 2x, 448/240, a calibration's other value)

Each function takes the capture and the differing rows (refmla.kvwrite.hypotheses.Mismatch) and
returns an :class:`~refmla.results.Explanation` or None.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch

from refmla.kvwrite import packed
from refmla.kvwrite.format import KvWriteCapture
from refmla.kvwrite.reference import Variant, fp8_max, is_fp8, same_bytes, scaled_input, written_rows
from refmla.results import Explanation
from refmla.sparse.layouts import FP8_DTYPES
from refmla.scales import read_as

ENCODINGS = ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2")
PACKED_ENCODINGS = ("float8_e4m3fn", "float8_e4m3fnuz")  # a V4 page's nope part (refmla.sparse.layouts)
# the ratios tried when the estimate from the bytes is not itself exact (a scale off by these is common)
RATIOS = (2.0, 0.5, 4.0, 0.25, 448.0 / 240.0, 240.0 / 448.0, 1.0 / 448.0, 1.0 / 240.0, 448.0, 240.0)


def _explained(hypothesis: str, detail: dict) -> Explanation:
    return Explanation(hypothesis=hypothesis, request=None, detail=detail, max_abs_err=0.0, residual_ratio=0.0)


def _where(cap: KvWriteCapture, tokens: list[int]) -> dict:
    slots = [int(cap.slots[t]) for t in tokens]
    out: dict = {"tokens": tokens[:64], "slots": slots[:64]}
    if cap.meta.packed:
        out["pages"] = [s // cap.meta.page_size for s in slots[:64]]
    return out


def as_encoding(cap: KvWriteCapture, kv_dtype: str) -> KvWriteCapture:
    """The same capture with its pool read as ``kv_dtype`` (the rows' bytes unchanged)."""
    return dataclasses.replace(cap, meta=dataclasses.replace(cap.meta, kv_dtype=kv_dtype), warnings=[])


def rows_as(cap: KvWriteCapture, variant: Variant) -> torch.Tensor:
    """[T, row bytes] uint8: the token rows a writer of ``variant`` stores (packed: the encoding only)."""
    if cap.meta.packed:
        return packed.written_rows(as_encoding(cap, variant.encoding or cap.meta.kv_dtype))
    return written_rows(cap, variant).contiguous().view(torch.uint8)


def reproduces(cap: KvWriteCapture, tokens: list[int], rows: torch.Tensor) -> bool:
    """Every token in ``tokens`` holds ``rows[token]`` at its slot, byte for byte."""
    if not tokens:
        return False
    after = cap.rows_after[cap.positions()[tokens]].contiguous().view(torch.uint8)
    return bool(same_bytes(after, rows[tokens]).all())


def encoding_mismatch(cap: KvWriteCapture, mm) -> Optional[Explanation]:
    """The differing rows written in another fp8 encoding than the pool's."""
    read = cap.meta.kv_dtype
    if not is_fp8(read) or not mm.tokens or mm.others or cap.meta.packed_input == "pack":
        return None  # a pack writer stores the fp8 bytes it is given (their encoding is the latent's dtype)
    for written in PACKED_ENCODINGS if cap.meta.packed else ENCODINGS:
        if written == read:
            continue
        rows = rows_as(cap, Variant(encoding=written))
        if reproduces(cap, mm.tokens, rows):
            return _explained("kv_fp8_encoding_mismatch", {"written": written, "read": read,
                              "read_over_written": _value_ratio(cap, mm.tokens, written, read),
                              **_where(cap, mm.tokens)})  # fmt: skip
    return None


def _value_ratio(cap: KvWriteCapture, tokens: list[int], written: str, read: str) -> Optional[float]:
    """The median of |value read / value written| over the tokens' finite nonzero fp8 bytes."""
    after = cap.rows_after[cap.positions()[tokens]].contiguous().view(torch.uint8)
    width = packed.layout_of(cap.meta.kv_layout).d_nope if cap.meta.packed else after.shape[1]
    b = after[:, :width].contiguous()
    w, r = b.view(getattr(torch, written)).double(), b.view(getattr(torch, read)).double()
    ok = torch.isfinite(w) & torch.isfinite(r) & (w != 0) & (r != 0)
    return round(float((r[ok] / w[ok]).abs().median()), 6) if bool(ok.any()) else None


def cast_overflow(cap: KvWriteCapture, mm) -> Optional[Explanation]:
    """The differing rows are torch's cast of the scaled row: NaN (or its own rounding) past the range."""
    dtype = cap.meta.kv_dtype
    if cap.meta.packed or not is_fp8(dtype) or not mm.tokens or mm.others:
        return None
    over = scaled_input(cap).abs() > fp8_max(dtype)  # [T, D]
    if not bool(over[mm.tokens].any()):
        return None
    rows = rows_as(cap, Variant(cast="torch"))
    if not reproduces(cap, mm.tokens, rows):
        return None
    stored = written_rows(cap, Variant(cast="torch"))[mm.tokens].float()
    nan = int(torch.isnan(stored).sum())
    first = float(scaled_input(cap)[mm.tokens].abs()[over[mm.tokens]].min())
    return _explained("kv_cast_overflow", {"kv_dtype": dtype, "elements": int(over[mm.tokens].sum()),
                      "stored_nan": nan, "smallest_overflowing": round(first, 4), "scale": cap.scale_value(),
                      "cast": f"torch {torch.__version__} x.to({dtype})", **_where(cap, mm.tokens)})  # fmt: skip


def packed_cast_overflow(cap: KvWriteCapture, mm) -> Optional[Explanation]:
    """A V4 latent writer's tiles scaled for the other e4m3's range and cast into the pool's: values
    past the pool's range stored saturated or, by torch's own cast, as NaN (module docstring)."""
    m = cap.meta
    if not m.packed or m.packed_input != "latent" or not mm.tokens or mm.others:
        return None
    lay, pool = packed.layout_of(m.kv_layout), FP8_DTYPES[m.kv_dtype]
    for other in PACKED_ENCODINGS:
        if other == m.kv_dtype or packed.fp8_max(other) <= packed.fp8_max(m.kv_dtype):
            continue  # a smaller range never overflows the pool's
        e = packed.exponents(cap.latent, lay, other, m.amax_floor)  # [T, tiles]
        inv = ((254 - e.long()).to(torch.int32) << 23).contiguous().view(torch.float32)  # 2^(127 - e)
        x = cap.latent.to(torch.float32).reshape(cap.tokens, lay.num_tiles, lay.tile) * inv[..., None]
        big = torch.tensor(packed.fp8_max(other), dtype=torch.float32)
        x = torch.fmax(torch.fmin(x, big), -big).reshape(cap.tokens, -1)  # [T, d_nope] the writer's clamp
        over = x.abs() > packed.fp8_max(m.kv_dtype)
        if not bool(over[mm.tokens].any()):
            continue
        lim = packed.fp8_max(m.kv_dtype)
        for how, stored in (("saturated", x.clamp(-lim, lim).to(pool)), ("torch", x.to(pool))):
            rows = packed.assemble(cap, stored.contiguous().view(torch.uint8), packed.rope_bytes(cap.rope), e)
            if not reproduces(cap, mm.tokens, rows):
                continue
            nan = int(torch.isnan(stored[mm.tokens].float()).sum())
            cast = (f"clamped to +-{lim:g}, then cast" if how == "saturated" else
                    f"torch {torch.__version__} x.to({m.kv_dtype}), no saturation")  # fmt: skip
            return _explained("kv_cast_overflow", {"kv_dtype": m.kv_dtype, "range_of": other,
                              "elements": int(over[mm.tokens].sum()), "stored_nan": nan,
                              "smallest_overflowing": round(float(x[mm.tokens].abs()[over[mm.tokens]].min()), 4),
                              "cast": cast, **_where(cap, mm.tokens)})  # fmt: skip
    return None


def scale_other_value(cap: KvWriteCapture, mm) -> Optional[Explanation]:
    """The differing rows divided by ``ratio`` times the recorded scale (estimated from the bytes)."""
    if cap.meta.packed or not is_fp8(cap.meta.kv_dtype) or not mm.tokens or mm.others:
        return None
    s = cap.scale_value()
    for read, how, value in read_as(s) if s != 1.0 else ():  # the recorded fp32 scale read in another format
        if reproduces(cap, mm.tokens, rows_as(cap, Variant(scale_used=value))):
            return _explained("kv_scale_format", {"scale": s, "stored": "fp32", "read": read, "how": how,
                              "value_read": value, **_where(cap, mm.tokens)})  # fmt: skip
    for r in _ratios(cap, mm.tokens):
        if reproduces(cap, mm.tokens, rows_as(cap, Variant(ratio=r))):
            s = cap.scale_value()
            return _explained("kv_scale_other_value", {"scale": s, "scale_used": float(torch.tensor(s, dtype=torch.float32) * r),
                              "ratio": round(r, 9), **_where(cap, mm.tokens)})  # fmt: skip
    return None


def _ratios(cap: KvWriteCapture, tokens: list[int]) -> list[float]:
    """The ratios to try: the one the bytes say (the median of documented / stored over normal values)
    snapped to a power of two or a common ratio first, then as estimated, then RATIOS."""
    x = scaled_input(cap)[tokens].double()  # [t, D]
    v = cap.rows_after[cap.positions()[tokens]].double()
    m = fp8_max(cap.meta.kv_dtype)
    ok = torch.isfinite(v) & (v.abs() >= 1.0) & (v.abs() < m) & (x != 0)
    out: list[float] = []
    if bool(ok.any()):
        est = float((x[ok] / v[ok]).median())
        if est > 0 and math.isfinite(est):
            near = [r for r in RATIOS if abs(math.log(r / est)) < 0.07]  # a common ratio before the estimate
            out = [2.0 ** round(math.log2(est))] + near + [est, round(est, 3), round(est, 2)]
    return [r for r in dict.fromkeys(out + list(RATIOS)) if r != 1.0]


__all__ = ["ENCODINGS", "as_encoding", "cast_overflow", "packed_cast_overflow", "encoding_mismatch", "reproduces", "rows_as",
           "scale_other_value"]  # fmt: skip
