"""Faults of the bytes between the KV writer and the decode kernel (docs/kv-bytes.md), planted on a
dense or block-table capture with refmla.synthetic.blocktable_faults' own loop (``attend``: a plain
fp64 softmax over the rows a broken kernel reads; the reference the replay tests is never called):

    kv_fp8_encoding_mismatch  fp8 pool: the kernel read the e4m3fn bytes as e4m3fnuz (DeepSeek-V4 on
                              MI300X: every key and value halved; the pool's -0 bytes, NaN in e4m3fnuz,
                              stored as +0 so the output stays finite)      -> kv_fp8_encoding_mismatch
    kv_scale_format           fp8 pool, k_scale = v_scale = 0.0131 (fp32): the kernel read them as
                              UE8M0, rounded down to a power of two (2^-7)    -> kv_scale_format
    kv_page_stride            block table: the kernel found page p at row p * page_size / 2 (a bf16
                              cache strided as fp8); the pool's unwritten rows stale and finite,
                              as a reused pool holds them                     -> kv_page_stride
"""

from __future__ import annotations

import dataclasses
import struct

import torch

from refmla.synthetic.blocktable_faults import attend, with_table
from refmla.synthetic.faults import Planting, fault
from refmla.synthetic.spec import SynthSpec

FORMAT_SCALE = 0.0131  # an fp32 dequant scale that is not a power of two (a calibration's)


def _fp8(spec: SynthSpec, scale: float = 0.5) -> SynthSpec:
    return dataclasses.replace(spec, name=f"{spec.name}-fp8", kv_dtype=torch.float8_e4m3fn, k_scale=scale, v_scale=scale)


def _ue8m0_down(x: float) -> float:
    """The fp32's exponent field as a UE8M0 scale (this module's own bit arithmetic)."""
    return 2.0 ** (((struct.unpack("<I", struct.pack("<f", x))[0] >> 23) & 0xFF) - 127)


def _rows(p: Planting) -> dict:
    return {b: p.t["kv_indices"][slice(*p.bounds(b))].long() for b in range(p.t["q"].shape[0])}


@fault("kv_fp8_encoding_mismatch", "fp8 pool: the kernel read the e4m3fn bytes as e4m3fnuz (MI300X's encoding)",
       spec=_fp8)  # fmt: skip
def _encoding(p: Planting):
    kv = p.t["kv_buffer"]
    kv.view(torch.uint8)[kv.view(torch.uint8) == 0x80] = 0  # -0 -> +0: e4m3fnuz has no -0 (0x80 is its NaN)
    p.t["kv_buffer"] = kv.view(torch.uint8).view(torch.float8_e4m3fnuz)
    try:
        out = attend(p, _rows(p))
    finally:
        p.t["kv_buffer"] = kv
    return out, {"written": "float8_e4m3fn", "read": "float8_e4m3fnuz"}


@fault("kv_scale_format", f"fp8 pool, k_scale = v_scale = {FORMAT_SCALE} (fp32): the kernel read both as UE8M0 "
       "(rounded down to a power of two)", spec=lambda s: _fp8(s, FORMAT_SCALE))  # fmt: skip
def _scale_format(p: Planting):
    used = _ue8m0_down(p.spec.k_scale)
    return attend(p, _rows(p), k_scale=used, v_scale=used), {"stored": "fp32", "read": "ue8m0", "value_read": used}


def _paged(spec: SynthSpec) -> SynthSpec:
    return spec if spec.page_size >= 4 else dataclasses.replace(spec, page_size=16)


@fault("kv_page_stride", "block table: the kernel found page p at row p * page_size / 2 (a bf16 cache strided "
       "as fp8)", spec=_paged)  # fmt: skip
def _page_stride(p: Planting):
    table, _ = with_table(p)
    t, P = p.t, p.spec.page_size
    kv = t["kv_buffer"]
    bad = torch.isnan(kv.float()).flatten(1).any(-1)  # rows never written: stale and finite, as a reused pool
    g = torch.Generator().manual_seed(p.spec.seed + 17)
    stale = torch.randn(int(bad.sum()), *kv.shape[1:], generator=g) / (p.spec.k_scale if kv.dtype.itemsize == 1 else 1)
    kv.view(torch.uint8)[bad] = stale.to(kv.dtype).view(torch.uint8)
    w = P // 2
    rows = {}
    for b in range(t["q"].shape[0]):
        pos = torch.arange(p.bounds(b)[1] - p.bounds(b)[0])
        rows[b] = table[b].long()[pos // P] * w + pos % P
    row_bytes = kv.shape[-1] * kv.dtype.itemsize
    return attend(p, rows), {"stride": w * row_bytes, "page_stride": P * row_bytes, "cache": "kv"}
