"""Sparse decode presets: real per-rank shapes of DeepSeek-V4-Flash and DeepSeek-V3.2 at TP8.

Numbers as SGLang 0.5.23 reads the models' configs (``srt/configs/deepseek_v4.py``
``DeepSeekV4Config``: 64 attention heads, head_dim 448 + 64 = 512, v_head_dim 512, index_topk 512,
window_size 128; ``DeepseekV4HipRadixBackend``: page 256, the SWA index width the window, the C4
cache's page 256 / 4 = 64 rows, C128's 256 / 128 = 2 rows, index widths padded to 64; the
softmax scale head_dim ** -0.5). Its compress ratio is per layer: ``DeepseekV4Attention`` takes
``config.compress_ratios[layer_id]`` (one of 0, 1, 2, 4, 128) and hands it to the backend's
``_forward_attention``; V4-Flash's list (``V4_FLASH_COMPRESS_RATIOS``, 43 layers + the MTP layer) is
two window-only layers, then C4 and C128 alternating, the MTP layer window-only. The three V4
presets are one layer of each kind (C4: layer 2, C128: layer 3, window only: layer 0), with no
layer named in their captures (the goldens); :func:`for_layer` gives the preset of one layer of the
model, its ratio, extra-cache geometry and ``layer_id`` read from the list.

DeepSeek-V3.2 (HF config): 128 heads, kv_lora_rank 512 +
rope 64 = 576, index_topk 2048, DSA page 64, softmax scale 192 ** -0.5 x mscale^2 (yarn factor
40, mscale_all_dim 1: mscale = 0.1 ln 40 + 1), no sink, one cache. Its fp32 tile scales are powers
of two (FlashMLA's quantizer); ``deepseek-v3.2-tp8-sglang`` stores amax / 448 as SGLang's V3.2 NSA fp8
store does (``dsa_quant_k_cache``), shorter contexts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional

from refmla.sparse.format import COMPRESS_RATIOS

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
    compress_ratios: tuple = ()  # the model's per-layer ratios (config.compress_ratios); () for V3.2
    layer_id: Optional[int] = None  # the layer of the model this case is (None: a layer of this kind, unnamed)
    scales: str = "ue8m0"  # V3.2's fp32 tile scales: "ue8m0" (powers of two, FlashMLA's) | "amax" (amax / 448, SGLang's)

    @property
    def layer_role(self) -> str:
        return "compressed" if self.compress_ratio > 0 else "window"

    @property
    def has_extra(self) -> bool:
        return self.extra_topk > 0


def _pad64(n: int) -> int:
    return -(-n // 64) * 64


# DeepSeek-V4-Flash config.json ``compress_ratios``: layers 0, 1 window only, then C4 / C128
# alternating (layers 2..42), the MTP layer (43) window only: num_hidden_layers + 1 = 44 entries.
# SGLang 0.5.23 ships no copy (it reads the checkpoint's config); this is the published list as a
# third-party loader's test of the Flash config spells it, not checked against the checkpoint here.
V4_FLASH_COMPRESS_RATIOS = (0, 0) + (4, 128) * 20 + (4, 0)
V4_INDEX_TOPK = 512  # DeepSeekV4Config.index_topk: the C4 indexer's width

V4_FLASH = SparsePreset(
    name="deepseek-v4-flash-tp8", model="deepseek-ai/DeepSeek-V4-Flash", kv_layout="v4", heads=64 // 8,
    softmax_scale=512**-0.5, head_dim_v=512, page_size=256, topk=128, window=128, compress_ratio=4,
    extra_topk=V4_INDEX_TOPK, extra_page_size=256 // 4, seq_lens=(1, 60, 600, 2100), compress_ratios=V4_FLASH_COMPRESS_RATIOS,
)  # fmt: skip


def _c128_topk(p: SparsePreset) -> int:
    """C128's index width: every compressed token of the longest request, padded to 64."""
    return _pad64(math.ceil(max(p.seq_lens) / 128))

PRESETS: dict[str, SparsePreset] = {
    p.name: p
    for p in (
        V4_FLASH,
        replace(V4_FLASH, name="deepseek-v4-flash-tp8-c128", compress_ratio=128, extra_page_size=256 // 128,
                extra_topk=_c128_topk(V4_FLASH)),  # fmt: skip
        replace(V4_FLASH, name="deepseek-v4-flash-tp8-swa", compress_ratio=0, extra_topk=0, extra_page_size=None),
        SparsePreset(name="deepseek-v3.2-tp8", model="deepseek-ai/DeepSeek-V3.2", kv_layout="v32", heads=128 // 8,
                     softmax_scale=192**-0.5 * V32_MSCALE**2, head_dim_v=512, page_size=64, topk=2048,
                     compress_ratio=0, sink=False, seq_lens=(1, 300, 2048, 2600)),  # fmt: skip
    )
}
PRESETS["deepseek-v3.2-tp8-sglang"] = replace(PRESETS["deepseek-v3.2-tp8"], name="deepseek-v3.2-tp8-sglang",
                                              scales="amax", seq_lens=(1, 300, 700))  # SGLang's V3.2 NSA fp8 store

def sparse_preset(name: str) -> SparsePreset:
    if name not in PRESETS:
        raise KeyError(f"unknown sparse preset {name!r}; known: {', '.join(PRESETS)}")
    return PRESETS[name]


def for_layer(p: SparsePreset, layer_id: int) -> SparsePreset:
    """The preset of one layer of the model: its ratio from the model's list, and the extra cache
    that ratio gives (none at 0; C4: page / 4, index width 512; C128: page / 128, every compressed
    token). Raises ValueError for a model without a per-layer list, a layer outside it, or a ratio
    (1, 2) whose index width the model's preset does not know."""
    if not p.compress_ratios:
        raise ValueError(f"preset {p.name} has no per-layer compress ratios (one cache, ratio {p.compress_ratio})")
    if not 0 <= layer_id < len(p.compress_ratios):
        raise ValueError(f"layer {layer_id} is outside {p.model}'s {len(p.compress_ratios)} layers (0..{len(p.compress_ratios) - 1})")
    ratio = p.compress_ratios[layer_id]
    if ratio == 0:
        return replace(p, layer_id=layer_id, compress_ratio=0, extra_topk=0, extra_page_size=None)
    if ratio not in (4, 128):
        raise ValueError(f"layer {layer_id}'s compress ratio {ratio}: only 0, 4 and 128 have known index widths")
    topk = V4_INDEX_TOPK if ratio == 4 else _c128_topk(p)
    return replace(p, layer_id=layer_id, compress_ratio=ratio, extra_page_size=p.page_size // ratio, extra_topk=topk)


assert len(V4_FLASH_COMPRESS_RATIOS) == 44 and set(V4_FLASH_COMPRESS_RATIOS) <= set(COMPRESS_RATIOS)

__all__ = ["PRESETS", "SparsePreset", "V4_FLASH_COMPRESS_RATIOS", "for_layer", "sparse_preset"]
