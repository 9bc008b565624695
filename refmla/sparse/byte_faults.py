"""The planted sparse faults of the bytes between the cache's writer and the decode kernel
(docs/kv-bytes.md): the keys a broken kernel reads, decoded from the pages' bytes by this module's
own arithmetic (torch's fp8 views, the scales' bits by struct), never by refmla.sparse.layouts'
decoder, which the replay measures with:

    kv_fp8_encoding_mismatch  V4: both caches' fp8 bytes read as e4m3fnuz (MI300X) where they were
                              written e4m3fn (the tile exponents as stored)
    kv_page_stride            V4: the main cache's pages read at the unpadded stride (page_size * 584
                              bytes) where the cache pads each page to a multiple of 576
    kv_scale_format           V3.2 with SGLang's fp32 scales (amax / 448, preset
                              deepseek-v3.2-tp8-sglang): each tile's scale read as UE8M0, its exponent
                              field (rounded down to a power of two)
"""

from __future__ import annotations

import struct

import torch

from refmla.sparse.synth import Pool

BYTE_FAULTS = ("kv_fp8_encoding_mismatch", "kv_page_stride", "kv_scale_format")
V4_DATA, V4_SCALES, V32_ROW = 576, 8, 656


def _ue8m0_down(x: float) -> float:
    return 2.0 ** (((struct.unpack("<I", struct.pack("<f", x))[0] >> 23) & 0xFF) - 127)


def _v4_token(flat: torch.Tensor, stride: int, page_size: int, t: int, fp8: torch.dtype) -> torch.Tensor:
    """[512] fp64: V4 token t read from the flat bytes with pages ``stride`` bytes apart."""
    p, s = divmod(t, page_size)
    data = flat[p * stride + s * V4_DATA :][:V4_DATA]
    e = flat[p * stride + page_size * V4_DATA + s * V4_SCALES :][:7].double()
    nope = data[:448].contiguous().view(fp8).double() * torch.exp2(e - 127).repeat_interleave(64)
    return torch.cat([nope, data[448:].contiguous().view(torch.bfloat16).double()])


def _v32_token(pool: Pool, t: int) -> torch.Tensor:
    """[576] fp64: V3.2 token t, its fp32 tile scales read as UE8M0 (rounded down)."""
    p, s = divmod(t, pool.page_size)
    row = pool.pages[p, s * V32_ROW : (s + 1) * V32_ROW]
    raw = bytes(row[512:528].tolist())
    scales = [_ue8m0_down(struct.unpack("<f", raw[4 * i : 4 * i + 4])[0]) for i in range(4)]
    nope = row[:512].contiguous().view(torch.float8_e4m3fn).double() * torch.tensor(scales).double().repeat_interleave(128)
    return torch.cat([nope, row[528:].contiguous().view(torch.bfloat16).double()])


def byte_keys(pool: Pool, tokens: list[int], fault: str) -> torch.Tensor:
    """[n, D] fp64: the keys of ``tokens`` a kernel with ``fault`` reads from ``pool``."""
    if not tokens:
        return torch.zeros(0, 576 if pool.layout == "v32" else 512, dtype=torch.float64)
    if fault == "kv_scale_format":
        return torch.stack([_v32_token(pool, t) for t in tokens])
    flat = pool.pages.reshape(-1)
    stride = int(pool.pages.shape[1])
    fp8 = torch.float8_e4m3fn
    if fault == "kv_page_stride":
        stride = pool.page_size * (V4_DATA + V4_SCALES)
        flat = torch.cat([flat, flat.new_zeros(stride)])  # the last page read past the cache's end: zeros
    else:
        fp8 = torch.float8_e4m3fnuz
    return torch.stack([_v4_token(flat, stride, pool.page_size, t, fp8) for t in tokens])


__all__ = ["BYTE_FAULTS", "byte_keys"]
