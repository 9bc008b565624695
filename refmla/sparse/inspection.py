"""`refmla inspect` of a sparse decode capture: what it holds, described from the format's own
meaning (the layout and its fp8 packing, each cache's geometry, the top-k widths and lengths, the
compress ratio, the pool's registered regions, the KV map diff-kv compares), typed (:class:`SparseInspection`).

The entry is the dense inspect's :class:`refmla.inspection.InspectEntry` (same keys, same exit
codes) with ``sparse`` added; an unreadable sparse capture is an invalid entry naming the file and
the key or tensor, as for a dense one.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Optional

import torch

from refmla.sparse.format import SparseCapture
from refmla.sparse.layouts import PackedLayout
from refmla.sparse.rows import sparse_rows
from refmla.util import dtype_name

MODELS = {"v4": "DeepSeek-V4 (FlashMLA MODEL1_FP8Sparse, SGLang KVLayout.V4)",
          "v32": "DeepSeek-V3.2 (FlashMLA V32_FP8Sparse)"}  # fmt: skip


def packing(layout: PackedLayout, fp8: str) -> str:
    """The bytes of one token, in words (docs/contract.md, "sparse decode captures")."""
    scales = (f"{layout.num_tiles} UE8M0 exponents (scale 2^(e - 127)) + {layout.scale_bytes - layout.num_tiles} pad"
              if layout.scale_kind == "ue8m0" else f"{layout.num_tiles} fp32 scales")  # fmt: skip
    order = ("block-split pages: page_size data rows, then page_size scale rows" if layout.block_split
             else "token-contiguous: fp8, scales, rope")  # fmt: skip
    return (f"{layout.d_nope} {fp8} in {layout.num_tiles} tiles of {layout.tile} + {layout.d_rope} bf16 rope "
            f"+ {scales} = {layout.bytes_per_token} bytes/token; {order}; page stride a multiple of {layout.page_align}")


@dataclass(frozen=True)
class CacheGeometry:
    """One paged cache as stored, and what the index lists read of it."""

    name: str  # "k_cache" | "extra_k_cache"
    role: str  # "main" (V4: the window cache) | "extra" (V4: the compressed cache)
    layout: str  # "v4" | "v32"
    packing: str  # the layout's bytes per token, in words
    bytes_per_token: int
    page_size: int  # tokens per page
    pages: int
    page_stride: int  # bytes per stored page (W), padding included
    layout_page_bytes: int  # what the layout needs per page (page_stride >= this)
    tokens: int  # pages x page_size
    index_width: int  # K: entries per query row's index list
    length_min: Optional[int]  # topk_length over the requests (None: no lengths, the width is read)
    length_max: Optional[int]
    valid_entries: int  # entries read over every query row (not -1, before the length)
    positions_held: Optional[int] = None  # the KV map: positions this cache holds over the requests (None: no map)
    page_map: bool = False  # the KV map's production page of each captured page is stored


@dataclass(frozen=True)
class SparseInspection:
    layout: str  # "v4" | "v32"
    model_layout: str  # the layout in words (DeepSeek-V4 MODEL1 / DeepSeek-V3.2)
    kernel_backend: str  # meta backend: the kernel SGLang chose
    shape: dict  # B, S, H, D, Dv
    q_dtype: str
    kv_fp8_dtype: str
    softmax_scale: float
    compress_ratio: Optional[int]
    layer_role: Optional[str]
    window: Optional[int]
    sink: bool  # an attention sink is stored
    caches: list  # [CacheGeometry]: main, then extra
    lonely_rows: int  # query rows with no valid entry in either cache (out 0, lse +inf)
    outputs: list  # the stored outputs: out, lse, golden_out, golden_lse
    pool_regions: Optional[list] = None  # meta kv_pool_region_bytes: each registered buffer's bytes
    pool_class: Optional[str] = None
    disagg_mode: Optional[str] = None  # meta disagg_mode: the node of a disaggregated run

    def to_json(self) -> dict:
        return {**asdict(self), "caches": [asdict(c) for c in self.caches]}


def _lengths(t: Optional[torch.Tensor]) -> tuple[Optional[int], Optional[int]]:
    return (None, None) if t is None or t.numel() == 0 else (int(t.min()), int(t.max()))


def _cache(cap: SparseCapture, extra: bool, valid: int) -> CacheGeometry:
    m = cap.meta
    layout, page = (m.extra_layout, m.extra_page_size) if extra else (m.layout, m.page_size)
    cache = cap.extra_k_cache if extra else cap.k_cache
    idx = cap.extra_indices if extra else cap.indices
    lo, hi = _lengths(cap.extra_topk_length if extra else cap.topk_length)
    assert layout is not None and page is not None and cache is not None and idx is not None  # validated
    slots = cap.extra_slots if extra else cap.slots
    return CacheGeometry("extra_k_cache" if extra else "k_cache", "extra" if extra else "main", layout.name,
                         packing(layout, m.kv_fp8_dtype), layout.bytes_per_token, page, cache.shape[0],
                         cache.shape[1], layout.page_bytes(page), cache.shape[0] * page, idx.shape[2], lo, hi, valid,
                         None if slots is None else int((slots >= 0).sum()),
                         (cap.extra_k_cache_pages if extra else cap.k_cache_pages) is not None)  # fmt: skip


def describe(cap: SparseCapture) -> SparseInspection:
    """The description of a read (validated) sparse capture."""
    m = cap.meta
    rows = sparse_rows(cap.indices, cap.topk_length, cap.extra_indices, cap.extra_topk_length)
    per_pool = [int((rows.valid & (rows.pool_id == p)).sum()) for p in (0, 1)]
    caches = [_cache(cap, False, per_pool[0])] + ([_cache(cap, True, per_pool[1])] if cap.extra_k_cache is not None else [])
    B, S, H, D = cap.q.shape
    stored = [n for n in ("out", "lse", "golden_out", "golden_lse") if getattr(cap, n) is not None]
    return SparseInspection(m.kv_layout, MODELS[m.kv_layout], m.backend, {"B": B, "S": S, "H": H, "D": D, "Dv": m.head_dim_v},
                            dtype_name(cap.q.dtype), m.kv_fp8_dtype, m.softmax_scale, m.compress_ratio, m.layer_role,
                            m.window, cap.attn_sink is not None, caches, int(rows.lonely.sum()), stored,
                            m.extra.get("kv_pool_region_bytes"), m.extra.get("kv_pool_class"), m.disagg_mode)  # fmt: skip


__all__ = ["CacheGeometry", "SparseInspection", "describe", "packing"]
