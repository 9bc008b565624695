"""The KV writer capture (meta ``mode`` ``kv_write``, docs/contract.md "KV writer captures"): one
call of an MLA cache writer -- its inputs and the pool rows it touched, before and after.

Tensors (``T`` tokens written, ``N`` pool rows kept, ``D = kv_lora_rank + qk_rope_head_dim``):

    latent       [T, kv_lora_rank]      the writer's latent (``kv_c`` / ``cache_k_nope``), as given
    rope         [T, qk_rope_head_dim]  its rope part (``k_pe`` / ``cache_k_rope``); absent when 0 wide
    slots        [T] int                the pool slot each token was written to (the engine's own ids)
    scale        [1] fp32               the scale the writer was given (fp8: stored = x / scale)
    pool_slots   [N] int64              the pool rows kept: each written slot and its two neighbours
    rows_before  [N, D]                 those rows before the write, in the pool's dtype
    rows_after   [N, D]                 and after it

A packed capture (meta ``kv_layout`` ``v4``, DeepSeek-V4's UE8M0 pages: refmla.kvwrite.packed)
keeps each kept slot's bytes instead, rows [N, 584] uint8 (its data row, then its scale row), with
``latent`` / ``rope`` what its writer was given: the [T, 448] + [T, 64] latent it quantizes, or
the pack (fp8 ``latent``, bf16 ``rope``, ``tile_scales`` [T, 7] uint8 exponents) it stores.

Every inconsistency is a :class:`~refmla.capture.CaptureError` naming the file and the tensor or key.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch

from refmla.capture.format import CaptureError
from refmla.capture.kinds import KindCapture, KindMeta, meta_int
from refmla.kvwrite import packed
from refmla.kvwrite.packed import INPUT_DTYPES, PACKED_INPUTS, PACKED_LAYOUTS

MODE = "kv_write"
TENSORS = {"latent": True, "rope": False, "slots": True, "scale": False, "pool_slots": True,
           "rows_before": True, "rows_after": True, "tile_scales": False}  # fmt: skip
# the pool dtypes a writer stores (a packed layout's: the fp8 of its nope part, meta kv_layout)
KV_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
             "float8_e4m3fn": torch.float8_e4m3fn, "float8_e4m3fnuz": torch.float8_e4m3fnuz,
             "float8_e5m2": torch.float8_e5m2}  # fmt: skip
FP8 = ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2")
PACKED_FP8 = ("float8_e4m3fn", "float8_e4m3fnuz")  # a packed page's nope part (refmla.sparse.layouts' e4m3)
# who divides by the scale: the writer itself (vLLM's concat_and_cache_mla, aiter's fused rope +
# quantize + cache write), or its caller before the call (SGLang's MLA pool: the backend divides k by
# layer.k_scale, the pool only casts) -- then the capture's inputs are already divided
SCALE_APPLIED = ("writer", "caller")
PADDING_SLOT = {"sglang": 0}  # the pool row SGLang reserves for padded tokens (never a request's)


def _sglang(meta: "KvWriteMeta") -> bool:
    return meta.engine == "sglang" or meta.writer.startswith("sglang.")


@dataclass
class KvWriteMeta(KindMeta):
    mode: str  # "kv_write"
    writer: str  # the writer wrapped, e.g. "sglang.MLATokenToKVPool.set_mla_kv_buffer"
    kv_dtype: str  # the pool's dtype (KV_DTYPES)
    kv_lora_rank: int
    qk_rope_head_dim: int
    scale_applied: str = "writer"  # SCALE_APPLIED
    caller_k_scale: Optional[float] = None  # SGLang: layer.k_scale the caller divided by (information)
    page_size: Optional[int] = None
    disagg_mode: Optional[str] = None  # "prefill" on a prefill node (refmla disagg's writer link)
    kv_layout: Optional[str] = None  # PACKED_LAYOUTS ("v4"); None: one row of D values per slot
    packed_input: Optional[str] = None  # packed: "latent" (the writer quantizes) | "pack" (it stores a pack)
    amax_floor: Optional[float] = None  # packed latent writers: the tile amax floor of their UE8M0 rule

    @property
    def packed(self) -> bool:
        return self.kv_layout is not None

    @property
    def row_width(self) -> int:
        """A kept row's width: D values, or a packed token's bytes."""
        return packed.layout_of(self.kv_layout).bytes_per_token if self.packed else self.head_dim

    @property
    def row_dtype(self) -> torch.dtype:
        return torch.uint8 if self.packed else self.dtype

    @property
    def head_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def dtype(self) -> torch.dtype:
        return KV_DTYPES[self.kv_dtype]

    def summary(self) -> str:
        if self.packed:
            return (f"writer {self.writer}  {self.kv_layout} pages of {self.page_size} (fp8 {self.kv_dtype}, UE8M0 "
                    f"tiles) D={self.kv_lora_rank}+{self.qk_rope_head_dim}  given the {self.packed_input}{self.where()}")  # fmt: skip
        return (f"writer {self.writer}  kv={self.kv_dtype} D={self.kv_lora_rank}+{self.qk_rope_head_dim}  "
                f"scale applied by the {self.scale_applied}{self.where()}")  # fmt: skip


def parse_kv_write_meta(raw: Any, path: Any) -> KvWriteMeta:
    """The meta of a kv_write capture, every key checked; CaptureError names the key."""
    if not isinstance(raw, dict):
        raise CaptureError(path, "header key 'meta'", "not a JSON object")
    if raw.get("mode") != MODE:
        raise CaptureError(path, "meta key 'mode'", f"expected {MODE!r}, got {raw.get('mode')!r}")
    for key, allowed in (("kv_dtype", tuple(KV_DTYPES)), ("scale_applied", SCALE_APPLIED)):
        if key in raw or key == "kv_dtype":
            if raw.get(key) not in allowed:
                raise CaptureError(path, f"meta key '{key}'", f"expected one of {', '.join(allowed)}, got {raw.get(key)!r}")
    if not isinstance(raw.get("writer"), str):
        raise CaptureError(path, "meta key 'writer'", "missing or not a string")
    meta = KvWriteMeta(
        mode=MODE, writer=raw["writer"], kv_dtype=raw["kv_dtype"], kv_lora_rank=meta_int(raw, "kv_lora_rank", path, 1),
        qk_rope_head_dim=meta_int(raw, "qk_rope_head_dim", path), scale_applied=raw.get("scale_applied", "writer"),
    )  # fmt: skip
    meta.read_common(raw, path, ints=("page_size",), strings=("disagg_mode",))
    cks = raw.get("caller_k_scale")
    if cks is not None:
        if isinstance(cks, bool) or not isinstance(cks, (int, float)) or not math.isfinite(cks) or cks <= 0:
            raise CaptureError(path, "meta key 'caller_k_scale'", f"expected a finite positive number, got {cks!r}")
        meta.caller_k_scale = float(cks)
    if raw.get("kv_layout") is not None:
        _parse_packed(meta, raw, path)
    return meta


def _parse_packed(meta: KvWriteMeta, raw: dict, path: Any) -> None:
    """The keys of a packed capture (meta kv_layout), each checked; CaptureError names the key."""
    def bad(key: str, why: str) -> CaptureError:
        return CaptureError(path, f"meta key '{key}'", why)

    if raw["kv_layout"] not in PACKED_LAYOUTS:
        raise bad("kv_layout", f"expected one of {', '.join(PACKED_LAYOUTS)}, got {raw['kv_layout']!r}")
    lay = packed.layout_of(raw["kv_layout"])
    if meta.kv_dtype not in PACKED_FP8:
        raise bad("kv_dtype", f"a {raw['kv_layout']} page stores fp8 ({', '.join(PACKED_FP8)}), got {meta.kv_dtype!r}")
    if raw.get("packed_input") not in PACKED_INPUTS:
        raise bad("packed_input", f"expected one of {', '.join(PACKED_INPUTS)}, got {raw.get('packed_input')!r}")
    for key, want in (("kv_lora_rank", lay.d_nope), ("qk_rope_head_dim", lay.d_rope)):
        if getattr(meta, key) != want:
            raise bad(key, f"a {lay.name} page holds {want}, got {getattr(meta, key)}")
    meta.kv_layout, meta.packed_input = raw["kv_layout"], raw["packed_input"]
    meta.page_size = meta_int(raw, "page_size", path, 1)
    floor = raw.get("amax_floor")
    if meta.packed_input == "latent" or floor is not None:
        number = isinstance(floor, (int, float)) and not isinstance(floor, bool)
        if not number or not math.isfinite(floor) or not 0 < floor <= 1:
            raise bad("amax_floor", f"expected a finite number in (0, 1] (a quantizing writer's), got {floor!r}")
        meta.amax_floor = float(floor)


@dataclass
class KvWriteCapture(KindCapture):
    meta: KvWriteMeta
    latent: torch.Tensor
    slots: torch.Tensor
    pool_slots: torch.Tensor
    rows_before: torch.Tensor
    rows_after: torch.Tensor
    rope: Optional[torch.Tensor] = None
    scale: Optional[torch.Tensor] = None
    tile_scales: Optional[torch.Tensor] = None  # packed "pack" writers: the [T, tiles] UE8M0 exponents given

    def validate(self) -> None:
        validate(self)

    @property
    def tokens(self) -> int:
        return int(self.latent.shape[0])

    def scale_value(self) -> float:
        """The scale the writer divides by (1.0 when none was given, or the caller applied it)."""
        if self.scale is None or self.meta.scale_applied == "caller":
            return 1.0
        return float(self.scale.reshape(-1)[0])

    def padding_tokens(self) -> list[int]:
        """Tokens written to the engine's padding slot: SGLang's reserved slot 0 (the padded tokens of a
        CUDA-graph batch write there, or a writer skips them); vLLM's -1 never reaches a capture."""
        if not _sglang(self.meta) or not self.tokens:
            return []
        return [int(t) for t in (self.slots == PADDING_SLOT["sglang"]).nonzero()[:, 0]]

    def positions(self) -> torch.Tensor:
        """[T] the index into pool_slots of each token's slot."""
        return torch.searchsorted(self.pool_slots.long(), self.slots.long())


def _fail(cap: KvWriteCapture, name: str, why: str) -> None:
    raise CaptureError(cap.path, f"tensor '{name}'", why)


def validate(cap: KvWriteCapture) -> None:
    """Shapes, dtypes, slots inside the kept rows, a finite positive scale; CaptureError on the first."""
    m, T = cap.meta, cap.latent.shape[0] if cap.latent.dim() == 2 else -1
    if cap.latent.dim() != 2 or cap.latent.shape[1] != m.kv_lora_rank:
        _fail(cap, "latent", f"shape {list(cap.latent.shape)}, expected [T, {m.kv_lora_rank}] (kv_lora_rank)")
    if m.packed:
        problem = packed.input_problem(cap)
        if problem:
            _fail(cap, *problem)
    elif cap.tile_scales is not None:
        _fail(cap, "tile_scales", "only a packed capture (meta kv_layout) holds tile scales")
    for name in ("latent", "rope") if not m.packed else ():
        t = getattr(cap, name)
        if t is not None and t.dtype not in INPUT_DTYPES:
            _fail(cap, name, f"dtype {t.dtype}, expected bfloat16, float16 or float32")
    if m.qk_rope_head_dim and (cap.rope is None or list(cap.rope.shape) != [T, m.qk_rope_head_dim]):
        got = "missing" if cap.rope is None else f"shape {list(cap.rope.shape)}"
        _fail(cap, "rope", f"{got}, expected [{T}, {m.qk_rope_head_dim}] (qk_rope_head_dim)")
    if cap.slots.dim() != 1 or cap.slots.shape[0] != T or cap.slots.dtype not in (torch.int32, torch.int64):
        _fail(cap, "slots", f"shape {list(cap.slots.shape)} {cap.slots.dtype}, expected [{T}] int32 / int64")
    ps = cap.pool_slots
    if ps.dim() != 1 or ps.dtype != torch.int64 or (ps.numel() > 1 and not bool((ps[1:] > ps[:-1]).all())):
        _fail(cap, "pool_slots", "expected [N] int64, strictly increasing")
    for name in ("rows_before", "rows_after"):
        t = getattr(cap, name)
        if list(t.shape) != [ps.shape[0], m.row_width] or t.dtype != m.row_dtype:
            want = "uint8 (packed token bytes)" if m.packed else m.kv_dtype
            _fail(cap, name, f"shape {list(t.shape)} {t.dtype}, expected [{ps.shape[0]}, {m.row_width}] {want}")
    if T and bool((cap.slots < 0).any()):
        _fail(cap, "slots", f"negative slot {int(cap.slots.min())}")
    pos = cap.positions().clamp(max=max(ps.shape[0] - 1, 0))
    missing = (ps[pos] != cap.slots.long()) if ps.numel() else torch.ones(T, dtype=torch.bool)
    if T and bool(missing.any()):
        t = int(missing.nonzero()[0])
        _fail(cap, "slots", f"token {t} slot {int(cap.slots[t])} is not among the kept rows (pool_slots)")
    if cap.scale is not None and m.packed:
        _fail(cap, "scale", f"a {m.kv_layout} page's scales are per tile (UE8M0 exponents): no one scale applies")
    if cap.scale is not None:
        s = cap.scale.reshape(-1)
        if s.numel() != 1 or not s.dtype.is_floating_point or not math.isfinite(float(s[0])) or float(s[0]) <= 0:
            _fail(cap, "scale", f"expected one finite positive float, got {s.tolist()[:4]}")
    elif m.kv_dtype in FP8 and m.scale_applied == "writer" and not m.packed:
        _fail(cap, "scale", f"missing: an {m.kv_dtype} writer that applies its scale must record it")
    if T != len(set(cap.slots.tolist())):
        cap.warnings.append("some slots are written twice in this call: their rows are not compared")


def describe(cap: KvWriteCapture) -> dict:
    """What `refmla inspect` says of a writer capture: the call, its slots, the kept rows, the scale."""
    s = cap.slots.long()
    return {"writer": cap.meta.writer, "tokens_written": cap.tokens, "kept_rows": int(cap.pool_slots.shape[0]),
            "slots": [int(s.min()), int(s.max())] if cap.tokens else [], "kv_dtype": cap.meta.kv_dtype,
            "head_dim": f"{cap.meta.kv_lora_rank} + {cap.meta.qk_rope_head_dim}",
            "scale": cap.scale_value(), "scale_applied": cap.meta.scale_applied,
            "caller_k_scale": cap.meta.caller_k_scale,
            **(packed.describe_packed(cap) if cap.meta.packed else {})}  # fmt: skip


__all__ = ["FP8", "KV_DTYPES", "PACKED_FP8", "MODE", "PADDING_SLOT", "SCALE_APPLIED", "TENSORS", "KvWriteCapture", "KvWriteMeta", "describe",
           "parse_kv_write_meta", "validate"]  # fmt: skip
