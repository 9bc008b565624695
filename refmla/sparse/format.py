"""The sparse decode capture (docs/contract.md section 1, "sparse decode captures"): one call of
DeepSeek's sparse MLA decode (V3.2 DSA, V4 window + compressed caches), as the kernel got it.

Same container as every capture (safetensors, header ``format`` refmla.capture/1, ``meta`` JSON);
meta ``mode`` is ``sparse_decode``. Tensors (B requests, S query tokens each, H heads):

    q                  [B, S, H, D]   bf16 as the kernel got it (D = the layout's head_dim)
    k_cache            [P, W] uint8   the main (window) cache's pages as stored, W >= the layout's page bytes
    indices            [B, S, K]      int32 flat token indices page * page_size + offset, -1 invalid
    topk_length        [B]            optional: entries at position >= topk_length[b] are not read
    attn_sink          [H] fp32       optional: per-head sink logit (adds exp(sink - max) to the denominator;
                                      +inf: out 0, -inf: no sink, as FlashMLA defines it; NaN: a finding)
    extra_k_cache      [P2, W2] uint8 optional: the compressed cache (V4 C4 / C128), its own layout and page size
    extra_indices      [B, S, K2]     with extra_k_cache
    extra_topk_length  [B]            optional, with extra_k_cache
    out                [B, S, H, Dv]  optional: what production wrote
    lse                [B, S, H] fp32 optional: natural log, the sink not included, +inf on a row with no valid index
    inv_rope_freqs     [M, d_rope]    optional: SGLang's ``inv_rope`` (view_as_real(freqs_cis).flatten(-2)):
    inv_rope_positions [B * S]        the kernel applied the inverse rope to out[..., -d_rope:]
    golden_out         [B, S, H, Dv] fp64   golden files only (refmla.sparse.golden): the stored reference
    golden_lse         [B, S, H] fp64

Row tokens (optional, with the KV map): ``kv_token_ids`` / ``kv_origin`` [N] like ``slots``, each position's
token id and origin (refmla.capture.rows); diff-kv then pairs both caches by tokens (refmla.diffkv.tokens).

The KV map (optional, issue 28: what diff-kv and disagg compare position by position; the top-k
``indices`` name only what one call read):

    seq_lens             [B]      request b's length in tokens (the positions its KV has)
    slot_indptr, slots   [B + 1], [N]   request b's main-cache token (the numbering of ``indices``) of
                         each position 0 .. seq_lens[b] - 1, in position order; -1: not held there
                         (V4's window cache: before the window's first page)
    extra_slot_indptr,   [B + 1], [N2]  the same for the compressed cache: entry i (tokens
    extra_slots          [i * ratio, (i + 1) * ratio)) of request b, seq_lens[b] // compress_ratio entries
    k_cache_pages,       [P], [P2]  the production page of each captured page (the hook keeps only
    extra_k_cache_pages  the pages it needs): physical slot = pages[t // page_size] * page_size + t % page_size
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any, Mapping, Optional

import torch

from refmla.capture import CaptureError, check_meta_numbers
from refmla.capture.format import META_KEYS as DENSE_META_KEYS
from refmla.capture.format import _check_geometry as check_geometry
from refmla.region_check import PoolMeta, RegionCheck, check_region
from refmla.sparse.layouts import FP8_DTYPES, LAYOUTS, PackedLayout

SPARSE_MODE = "sparse_decode"
TENSORS = {
    "q": True, "k_cache": True, "indices": True, "topk_length": False, "attn_sink": False,
    "extra_k_cache": False, "extra_indices": False, "extra_topk_length": False, "out": False, "lse": False,
    "inv_rope_freqs": False, "inv_rope_positions": False, "golden_out": False, "golden_lse": False,
    "seq_lens": False, "slot_indptr": False, "slots": False, "extra_slot_indptr": False, "extra_slots": False,
    "k_cache_pages": False, "extra_k_cache_pages": False,
    "kv_token_ids": False, "kv_origin": False,  # like slots: each position's token id and origin (refmla.capture.rows)
}  # fmt: skip
KV_MAP = {"": ("slot_indptr", "slots", "k_cache_pages"), "extra_": ("extra_slot_indptr", "extra_slots", "extra_k_cache_pages")}
DISAGG_MODES = ("prefill", "decode", "null")
KERNEL_BACKENDS = ("aiter_sparse", "triton", "tilelang", "torch", "flashmla", "aiter", "synth", "unknown")
ROLES = ("window", "compressed")
COMPRESS_RATIOS = (0, 1, 2, 4, 128)  # what SGLang's DeepseekV4Attention accepts per layer

# key -> (type, required)
META_KEYS = {
    "mode": (str, True), "backend": (str, True), "kv_layout": (str, True), "page_size": (int, True),
    "softmax_scale": (float, True), "head_dim_v": (int, True), "extra_kv_layout": (str, False),
    "extra_page_size": (int, False), "kv_fp8_dtype": (str, False), "compress_ratio": (int, False),
    "layer_role": (str, False), "window": (int, False), "model": (str, False), "layer_id": (int, False),
    "tp_rank": (int, False), "step": (int, False), "sglang_version": (str, False), "rids": (list, False),
    "compress_ratios": (list, False), "disagg_mode": (str, False), "disagg_transfer_backend": (str, False),
}  # fmt: skip


@dataclass
class SparseMeta:
    mode: str  # "sparse_decode"
    backend: str  # the kernel SGLang chose (KERNEL_BACKENDS): aiter_sparse | triton | tilelang | ...
    kv_layout: str  # the main cache's packed layout: "v4" | "v32" (refmla.sparse.layouts)
    page_size: int  # tokens per page of the main cache
    softmax_scale: float  # exactly as passed to the kernel
    head_dim_v: int  # Dv, the output width
    extra_kv_layout: Optional[str] = None  # the extra (compressed) cache's layout
    extra_page_size: Optional[int] = None  # its tokens per page (V4 C4: page_size / 4, C128: / 128)
    kv_fp8_dtype: str = "float8_e4m3fn"  # float8_e4m3fn (gfx950, CUDA) | float8_e4m3fnuz (gfx942)
    compress_ratio: Optional[int] = None  # the layer's ratio: 0 (window only), 4 (C4), 128 (C128), 1, 2
    layer_role: Optional[str] = None  # "window" | "compressed"
    window: Optional[int] = None  # the sliding window (V4: 128)
    model: Optional[str] = None
    layer_id: Optional[int] = None
    tp_rank: Optional[int] = None
    step: Optional[int] = None
    sglang_version: Optional[str] = None
    rids: Optional[list] = None
    compress_ratios: Optional[list] = None  # the model's per-layer ratios (config.compress_ratios), when known
    disagg_mode: Optional[str] = None  # "prefill" | "decode" | "null": which node of a disaggregated run
    disagg_transfer_backend: Optional[str] = None  # "mori" | "mooncake" | "nixl" | ...
    extra: dict = field(default_factory=dict)  # keys this version does not know, kept as given

    @property
    def layout(self) -> PackedLayout:
        return LAYOUTS[self.kv_layout]

    @property
    def extra_layout(self) -> Optional[PackedLayout]:
        return None if self.extra_kv_layout is None else LAYOUTS[self.extra_kv_layout]

    def region(self) -> RegionCheck:
        """The MR region-size check of the pool geometry among the keys (refmla.region_check)."""
        return check_region(PoolMeta.from_raw({**self.to_json(), "page_size": self.page_size}))

    def to_json(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "extra"}
        return {**self.extra, **{k: v for k, v in d.items() if v is not None}}


def is_sparse_meta(raw: Any) -> bool:
    return isinstance(raw, Mapping) and raw.get("mode") == SPARSE_MODE


def parse_sparse_meta(raw: Mapping[str, Any], path: Any = "<meta>") -> SparseMeta:
    """Validate the meta of a sparse capture (types, then bounds) and build SparseMeta."""
    check_meta_numbers(raw, path)  # every numeric key's type, finiteness and range (refmla.capture.numbers)
    kw: dict[str, Any] = {}
    for key, (typ, required) in META_KEYS.items():
        if raw.get(key) is None:
            if required:
                raise CaptureError(path, f"meta key '{key}'", "missing")
            continue
        kw[key] = _coerce(raw[key], typ, path, key)
    for problem in meta_problems(kw):
        raise CaptureError(path, *problem)
    if kw.get("rids") is not None:  # strings, as a dense capture's (the pairing compares them)
        kw["rids"] = [str(r) for r in kw["rids"]]
    _layer_ratio(kw, path)
    extra = {k: v for k, v in raw.items() if k not in META_KEYS and k != "format"}
    _check_pool_geometry(extra, path)
    return SparseMeta(**kw, extra=extra)


def _layer_ratio(kw: dict, path: Any) -> None:
    """The layer's ratio from the model's per-layer list (``compress_ratios[layer_id]``), as SGLang's
    DeepseekV4Attention reads it: filled in when absent, refused when the capture says another."""
    ratios = kw.get("compress_ratios")
    if ratios is None:
        return
    bad = [r for r in ratios if isinstance(r, bool) or not isinstance(r, int) or r not in COMPRESS_RATIOS]
    if bad:
        raise CaptureError(path, "meta key 'compress_ratios'", f"entries must be one of {COMPRESS_RATIOS}, got {bad[0]!r}")
    layer = kw.get("layer_id")
    if layer is None:
        return
    if not 0 <= layer < len(ratios):
        raise CaptureError(path, "meta key 'layer_id'", f"{layer} is outside compress_ratios ({len(ratios)} layers)")
    if kw.get("compress_ratio") is None:
        kw["compress_ratio"] = ratios[layer]
    elif kw["compress_ratio"] != ratios[layer]:
        raise CaptureError(path, "meta key 'compress_ratio'",
                           f"{kw['compress_ratio']}, but the model's compress_ratios[{layer}] is {ratios[layer]}")
    if kw.get("layer_role") is None:
        kw["layer_role"] = "compressed" if kw["compress_ratio"] > 0 else "window"


def _check_pool_geometry(extra: dict, path: Any) -> None:
    """The pool-geometry keys a sparse capture carries (the MR region check): as typed and
    bounded as a dense capture's (docs/contract.md section 1, "pool geometry")."""
    keys = {k: v for k, v in extra.items() if k in DENSE_META_KEYS and (k.startswith("kv_pool") or k.startswith("mori"))}
    kw = {k: _coerce(v, DENSE_META_KEYS[k][0], path, k) for k, v in keys.items() if v is not None}
    check_geometry(kw, path)


def _coerce(value: Any, typ: type, path: Any, key: str) -> Any:
    ok = not isinstance(value, bool) and (
        isinstance(value, typ) or (typ is float and isinstance(value, int))
        or (typ is int and isinstance(value, float) and value.is_integer()))  # fmt: skip
    if not ok:
        raise CaptureError(path, f"meta key '{key}'", f"must be {'a finite ' if typ in (int, float) else ''}{typ.__name__}, got {_short(value)}")
    try:
        return typ(value) if typ in (int, float) else value
    except OverflowError:  # an int past float's range
        raise CaptureError(path, f"meta key '{key}'", f"must be a finite {typ.__name__}, got {_short(value)}") from None


def meta_problems(kw: dict) -> list[tuple[str, str]]:
    """(key, reason) for every bound the coerced meta breaks."""
    out = []
    for key, allowed in (("mode", (SPARSE_MODE,)), ("kv_layout", tuple(LAYOUTS)), ("layer_role", ROLES),
                         ("extra_kv_layout", tuple(LAYOUTS)), ("kv_fp8_dtype", tuple(FP8_DTYPES)),
                         ("disagg_mode", DISAGG_MODES)):  # fmt: skip
        if kw.get(key) is not None and kw[key] not in allowed:
            out.append((f"meta key '{key}'", f"must be one of {', '.join(allowed)}, got {kw[key]!r}"))
    for key in ("page_size", "extra_page_size", "head_dim_v"):
        if kw.get(key) is not None and not 1 <= kw[key] <= 1 << 16:
            out.append((f"meta key '{key}'", f"must be in [1, 65536], got {_short(kw[key])}"))
    s = kw.get("softmax_scale")
    if s is not None and not (math.isfinite(s) and 1e-6 <= s <= 1e3):
        out.append(("meta key 'softmax_scale'", f"{s!r} is outside the sane range [1e-06, 1e+03]"))
    if kw.get("compress_ratio") is not None and kw["compress_ratio"] not in COMPRESS_RATIOS:
        out.append(("meta key 'compress_ratio'", f"must be one of {COMPRESS_RATIOS}, got {kw['compress_ratio']!r}"))
    for key, lo, hi in (("window", 1, 1 << 20), ("layer_id", 0, 1 << 20), ("tp_rank", 0, 1 << 20), ("step", 0, 1 << 62)):
        if kw.get(key) is not None and not lo <= kw[key] <= hi:
            out.append((f"meta key '{key}'", f"must be in [{lo}, {hi}], got {_short(kw[key])}"))
    return out


def _short(v: Any) -> str:
    """A number for a message: a huge one by its digit count, not its 4,401 digits."""
    if isinstance(v, int) and abs(v).bit_length() > 80:
        return f"an integer of {abs(v).bit_length()} bits"
    text = str(v)
    return text if len(text) <= 24 else text[:24] + "..."


@dataclass
class SparseCapture:
    """One captured sparse decode call. Tensors keep the dtypes they were stored with."""

    path: str
    meta: SparseMeta
    q: torch.Tensor  # [B, S, H, D]
    k_cache: torch.Tensor  # [P, W] uint8
    indices: torch.Tensor  # [B, S, K]
    topk_length: Optional[torch.Tensor] = None  # [B]
    attn_sink: Optional[torch.Tensor] = None  # [H]
    extra_k_cache: Optional[torch.Tensor] = None  # [P2, W2] uint8
    extra_indices: Optional[torch.Tensor] = None  # [B, S, K2]
    extra_topk_length: Optional[torch.Tensor] = None  # [B]
    out: Optional[torch.Tensor] = None  # [B, S, H, Dv]
    lse: Optional[torch.Tensor] = None  # [B, S, H]
    inv_rope_freqs: Optional[torch.Tensor] = None  # [M, d_rope]
    inv_rope_positions: Optional[torch.Tensor] = None  # [B * S]
    golden_out: Optional[torch.Tensor] = None  # [B, S, H, Dv] fp64, golden files only
    golden_lse: Optional[torch.Tensor] = None  # [B, S, H] fp64
    seq_lens: Optional[torch.Tensor] = None  # [B] the KV map (module docstring)
    slot_indptr: Optional[torch.Tensor] = None  # [B + 1]
    slots: Optional[torch.Tensor] = None  # [N] main-cache tokens per position, -1 not held
    extra_slot_indptr: Optional[torch.Tensor] = None  # [B + 1]
    extra_slots: Optional[torch.Tensor] = None  # [N2] compressed-cache tokens per entry, -1 not held
    k_cache_pages: Optional[torch.Tensor] = None  # [P] production page of each captured page
    extra_k_cache_pages: Optional[torch.Tensor] = None  # [P2]
    kv_token_ids: Optional[torch.Tensor] = None  # [N] like slots: the token id of each position (refmla.capture.rows)
    kv_origin: Optional[torch.Tensor] = None  # [N] like slots: how each position's rows got into the caches
    warnings: list = field(default_factory=list)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """(B, S, H, D)."""
        return tuple(self.q.shape)  # type: ignore[return-value]

    @property
    def rows(self) -> int:
        """B * S query rows."""
        return self.q.shape[0] * self.q.shape[1]

    def request_of_row(self) -> torch.Tensor:
        return torch.arange(self.q.shape[0]).repeat_interleave(self.q.shape[1])

    def tensors(self) -> dict[str, torch.Tensor]:
        return {n: getattr(self, n) for n in TENSORS if getattr(self, n) is not None}

    def region(self) -> RegionCheck:
        """The MR region-size check of the pool geometry in meta (refmla.region_check)."""
        return self.meta.region()

    def cache_tokens(self, extra: bool = False) -> int:
        cache, page = (self.extra_k_cache, self.meta.extra_page_size) if extra else (self.k_cache, self.meta.page_size)
        return 0 if cache is None else cache.shape[0] * (page or 0)


__all__ = ["DISAGG_MODES", "KERNEL_BACKENDS", "KV_MAP", "META_KEYS", "SPARSE_MODE", "TENSORS", "SparseCapture", "SparseMeta",
           "is_sparse_meta", "meta_problems", "parse_sparse_meta"]  # fmt: skip
