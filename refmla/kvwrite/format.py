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

Every inconsistency is a :class:`~refmla.capture.CaptureError` naming the file and the tensor or key.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from refmla.capture.format import CaptureError
from refmla.capture.kinds import KindMeta, meta_int

MODE = "kv_write"
TENSORS = {"latent": True, "rope": False, "slots": True, "scale": False, "pool_slots": True,
           "rows_before": True, "rows_after": True}  # fmt: skip
# the pool dtypes a writer stores (packed UE8M0 tiles are not read by this kind yet)
KV_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
             "float8_e4m3fn": torch.float8_e4m3fn, "float8_e4m3fnuz": torch.float8_e4m3fnuz}  # fmt: skip
FP8 = ("float8_e4m3fn", "float8_e4m3fnuz")
# who divides by the scale: the writer itself (vLLM's concat_and_cache_mla, aiter's fused rope +
# quantize + cache write), or its caller before the call (SGLang's MLA pool: the backend divides k by
# layer.k_scale, the pool only casts) -- then the capture's inputs are already divided
SCALE_APPLIED = ("writer", "caller")
INPUT_DTYPES = {torch.bfloat16, torch.float16, torch.float32}


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

    @property
    def head_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def dtype(self) -> torch.dtype:
        return KV_DTYPES[self.kv_dtype]

    def summary(self) -> str:
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
    return meta


@dataclass
class KvWriteCapture:
    path: str
    meta: KvWriteMeta
    latent: torch.Tensor
    slots: torch.Tensor
    pool_slots: torch.Tensor
    rows_before: torch.Tensor
    rows_after: torch.Tensor
    rope: Optional[torch.Tensor] = None
    scale: Optional[torch.Tensor] = None
    warnings: list = field(default_factory=list)

    def __post_init__(self) -> None:
        validate(self)

    @property
    def tokens(self) -> int:
        return int(self.latent.shape[0])

    def scale_value(self) -> float:
        """The scale the writer divides by (1.0 when none was given, or the caller applied it)."""
        if self.scale is None or self.meta.scale_applied == "caller":
            return 1.0
        return float(self.scale.reshape(-1)[0])

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
    for name in ("latent", "rope"):
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
        if list(t.shape) != [ps.shape[0], m.head_dim] or t.dtype != m.dtype:
            _fail(cap, name, f"shape {list(t.shape)} {t.dtype}, expected [{ps.shape[0]}, {m.head_dim}] {m.kv_dtype}")
    if T and bool((cap.slots < 0).any()):
        _fail(cap, "slots", f"negative slot {int(cap.slots.min())}")
    pos = cap.positions().clamp(max=max(ps.shape[0] - 1, 0))
    missing = (ps[pos] != cap.slots.long()) if ps.numel() else torch.ones(T, dtype=torch.bool)
    if T and bool(missing.any()):
        t = int(missing.nonzero()[0])
        _fail(cap, "slots", f"token {t} slot {int(cap.slots[t])} is not among the kept rows (pool_slots)")
    if cap.scale is not None:
        s = cap.scale.reshape(-1)
        if s.numel() != 1 or not s.dtype.is_floating_point or not math.isfinite(float(s[0])) or float(s[0]) <= 0:
            _fail(cap, "scale", f"expected one finite positive float, got {s.tolist()[:4]}")
    elif m.kv_dtype in FP8 and m.scale_applied == "writer":
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
            "caller_k_scale": cap.meta.caller_k_scale}  # fmt: skip


__all__ = ["FP8", "KV_DTYPES", "MODE", "SCALE_APPLIED", "TENSORS", "KvWriteCapture", "KvWriteMeta", "describe",
           "parse_kv_write_meta", "validate"]  # fmt: skip
