"""A packed cache's bytes read another way than they were written: the decoders the sparse
``kv_fp8_encoding_mismatch``, ``kv_scale_format`` and ``kv_page_stride`` candidates read with
(refmla.sparse.hypotheses), each a function ``decode(cache, layout, page, fp8, tokens) -> [n, D]``
fp64 like :func:`refmla.sparse.layouts.dequantize`.

    as_fp8(read)          the fp8 bytes in another encoding (e4m3fn <-> e4m3fnuz, e5m2)
    scales_read_as(how)   a V3.2 page's fp32 tile scales read as bf16 or UE8M0 (SCALE_READINGS):
                            bf16   "its high half (truncated)", "its low half"
                            ue8m0  "its exponent (rounded down to a power of two)", "rounded up to a
                                   power of two", "its first byte as the exponent", "its bytes as
                                   UE8M0 exponents, one byte a tile" (a V4 reader given V3.2's scales)
    strided(stride)       the pages read at another page stride (bytes)

:func:`scale_readings` lists the readings that change at least one of a cache's written scales.
"""

from __future__ import annotations

from typing import Callable, Optional

import numpy as np
import torch

from refmla.sparse.layouts import FP8_DTYPES, PackedLayout, TokenBytes, dequantize, tile_scales, token_bytes

Decode = Callable[..., torch.Tensor]

# how -> what the reader takes the fp32 scale as (refmla.scales.read_as's words, per tile)
SCALE_READINGS = {
    "its high half (truncated)": "bf16",
    "its low half": "bf16",
    "its exponent (rounded down to a power of two)": "ue8m0",
    "rounded up to a power of two": "ue8m0",
    "its first byte as the exponent": "ue8m0",
    "its bytes as UE8M0 exponents, one byte a tile": "ue8m0",
}


def read_scales(b: TokenBytes, layout: PackedLayout, how: str) -> torch.Tensor:
    """[N, num_tiles] fp64: the fp32 tile scales of ``b`` as a reader taking them ``how`` gets them."""
    T = layout.num_tiles
    raw = b.scales[:, : 4 * T].contiguous()
    if how == "its bytes as UE8M0 exponents, one byte a tile":
        e = raw[:, :T].to(torch.float64)
        return torch.where(e == 255, torch.full_like(e, float("nan")), torch.exp2(e - 127.0))
    bits = raw.numpy().view(np.uint32).astype(np.uint64)  # [N, T]
    e = ((bits >> 23) & 0xFF).astype(np.float64)
    if how == "its high half (truncated)":
        v = (bits & 0xFFFF0000).astype(np.uint32).view(np.float32).astype(np.float64)
    elif how == "its low half":
        v = ((bits & 0xFFFF) << 16).astype(np.uint32).view(np.float32).astype(np.float64)
    elif how == "its exponent (rounded down to a power of two)":
        v = np.exp2(e - 127.0)
    elif how == "rounded up to a power of two":
        v = np.exp2(e - 127.0 + ((bits & 0x7FFFFF) != 0))
    elif how == "its first byte as the exponent":
        v = np.exp2((bits & 0xFF).astype(np.float64) - 127.0)
    else:
        raise ValueError(f"unknown scale reading {how!r}")
    return torch.from_numpy(np.ascontiguousarray(v))


def scales_read_as(how: str) -> Decode:
    def decode(cache, layout, page, fp8, tokens=None):
        b = token_bytes(cache.view(torch.uint8), layout, page)
        if tokens is not None:
            b = TokenBytes(b.nope[tokens], b.scales[tokens], b.rope[tokens])
        nope = b.nope.contiguous().view(FP8_DTYPES[fp8]).to(torch.float64)  # [n, d_nope]
        scales = read_scales(b, layout, how).repeat_interleave(layout.tile, dim=1)  # [n, d_nope]
        rope = b.rope.contiguous().view(torch.bfloat16).to(torch.float64)  # [n, d_rope]
        return torch.cat([nope * scales, rope], dim=1)

    return decode


def scale_readings(cache: torch.Tensor, layout: PackedLayout, page: int) -> list[tuple[str, str]]:
    """(read, how) for each reading of fp32 tile scales that changes a finite positive one (none for
    UE8M0 layouts): the ``kv_scale_format`` candidates."""
    if layout.scale_kind != "fp32":
        return []
    b = token_bytes(cache.view(torch.uint8), layout, page)
    stored = tile_scales(b, layout)  # [N, T]
    ok = torch.isfinite(stored) & (stored > 0)
    out = []
    for how, read in SCALE_READINGS.items():
        if bool(ok.any()) and bool((read_scales(b, layout, how)[ok] != stored[ok]).any()):
            out.append((read, how))
    return out


def as_fp8(fp8_read: str) -> Decode:
    def decode(cache, layout, page, fp8, tokens=None):
        return dequantize(cache, layout, page, fp8_read, tokens)

    return decode


def strided(stride: int) -> Decode:
    def decode(cache, layout, page, fp8, tokens: Optional[torch.Tensor] = None):
        flat = cache.contiguous().view(torch.uint8).reshape(-1)
        pages = -(-flat.numel() // stride)
        padded = torch.cat([flat, flat.new_zeros(pages * stride - flat.numel())])
        return dequantize(padded.view(pages, stride), layout, page, fp8, tokens)

    return decode


__all__ = ["SCALE_READINGS", "as_fp8", "read_scales", "scale_readings", "scales_read_as", "strided"]
