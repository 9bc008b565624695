"""Sparse decode presets: real per-rank shapes of DeepSeek-V4-Flash and DeepSeek-V3.2 at TP8.

Numbers as SGLang 0.5.23 reads the models' configs (``srt/configs/deepseek_v4.py``
``DeepSeekV4Config``: 64 attention heads, head_dim 448 + 64 = 512, v_head_dim 512, index_topk 512,
window_size 128; ``DeepseekV4HipRadixBackend``: page 256, the SWA index width the window, the C4
cache's page 256 / 4 = 64 rows, C128's 256 / 128 = 2 rows, index widths padded to 64; the
softmax scale head_dim ** -0.5). DeepSeek-V3.2 (HF config): 128 heads, kv_lora_rank 512 +
rope 64 = 576, index_topk 2048, DSA page 64, softmax scale 192 ** -0.5 x mscale^2 (yarn factor
40, mscale_all_dim 1: mscale = 0.1 ln 40 + 1), no sink, one cache.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional

V32_MSCALE = 0.1 * math.log(40.0) + 1.0


@dataclass(frozen=True)
class SparsePreset:
    name: str
    model: str
    kv_layout: str  # the main cache's layout: "v4" | "v32"
    heads: int  # query heads per rank (TP8)
    softmax_scale: float
    head_dim_v: int
    page_size: int  # main cache page
    topk: int  # main index width (V4: the window; V3.2: index_topk)
    compress_ratio: int  # 0: window only; 4: C4; 128: C128
    window: Optional[int] = None  # V4's sliding window (the main cache's valid entries per row)
    extra_topk: int = 0  # the compressed cache's index width (0: no extra cache)
    extra_page_size: Optional[int] = None
    sink: bool = True  # V4 has a per-head sink; V3.2 none
    seq_lens: tuple = (1, 130, 600, 2100)  # context per request: a one-token row, short and long ones
    seed: int = 0

    @property
    def layer_role(self) -> str:
        return "compressed" if self.compress_ratio > 0 else "window"

    @property
    def has_extra(self) -> bool:
        return self.extra_topk > 0


def _pad64(n: int) -> int:
    return -(-n // 64) * 64


V4_FLASH = SparsePreset(
    name="deepseek-v4-flash-tp8", model="deepseek-ai/DeepSeek-V4-Flash", kv_layout="v4", heads=64 // 8,
    softmax_scale=512**-0.5, head_dim_v=512, page_size=256, topk=128, window=128, compress_ratio=4,
    extra_topk=512, extra_page_size=256 // 4, seq_lens=(1, 60, 600, 2100),
)  # fmt: skip

PRESETS: dict[str, SparsePreset] = {
    p.name: p
    for p in (
        V4_FLASH,
        replace(V4_FLASH, name="deepseek-v4-flash-tp8-c128", compress_ratio=128, extra_page_size=256 // 128,
                extra_topk=_pad64(math.ceil(max(V4_FLASH.seq_lens) / 128))),  # fmt: skip
        replace(V4_FLASH, name="deepseek-v4-flash-tp8-swa", compress_ratio=0, extra_topk=0, extra_page_size=None),
        SparsePreset(name="deepseek-v3.2-tp8", model="deepseek-ai/DeepSeek-V3.2", kv_layout="v32", heads=128 // 8,
                     softmax_scale=192**-0.5 * V32_MSCALE**2, head_dim_v=512, page_size=64, topk=2048,
                     compress_ratio=0, sink=False, seq_lens=(1, 300, 2048, 2600)),  # fmt: skip
    )
}


def sparse_preset(name: str) -> SparsePreset:
    if name not in PRESETS:
        raise KeyError(f"unknown sparse preset {name!r}; known: {', '.join(PRESETS)}")
    return PRESETS[name]


__all__ = ["PRESETS", "SparsePreset", "sparse_preset"]
