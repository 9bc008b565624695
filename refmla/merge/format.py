"""The merge capture (meta ``mode`` ``merge``, docs/contract.md "merge captures"): one call of a
state merge that joins two pieces of attention -- chunked-prefix prefill's per-chunk partials,
decode context parallelism's per-rank partials -- into one.

Tensors (``T`` query rows, ``H`` heads, ``D`` value width; lse always [T, H], the hook transposes
vLLM's [H, T]):

    out_a, out_b   [T, H, D]   the pieces' outputs (each normalised over its own keys)
    lse_a, lse_b   [T, H] fp32 the pieces' log-sum-exp, in the base the merger documents (meta lse_base)
    out            [T, H, D]   the merged output production wrote
    lse            [T, H] fp32 the merged lse (optional: not every merge returns it)
    len_a, len_b   [T] int     keys each piece attended per row (optional; 0 = an empty piece)

An empty piece (no keys) has lse -inf by the convention every merger documents; one recorded with
a finite lse is recognised by ``len_*`` == 0 or by its output row being exactly zero.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch

from refmla.arithmetic import LSE_BASE_ALIASES, lse_base_of
from refmla.capture.format import CaptureError
from refmla.capture.kinds import KindCapture, KindMeta

MODE = "merge"
TENSORS = {"out_a": True, "lse_a": True, "out_b": True, "lse_b": True, "out": True, "lse": False,
           "len_a": False, "len_b": False}  # fmt: skip
LSE_BASES = ("e", "2")  # natural log (SGLang merge_state / _v2, vLLM merge_attn_states), log2 (FlashInfer, aiter)
MERGE_SPELLING = {"ln": "e", "log2": "2"}  # a merge capture's meta says e / 2; ln / log2 are read as aliases
OUT_DTYPES = {torch.bfloat16, torch.float16, torch.float32}


@dataclass
class MergeMeta(KindMeta):
    mode: str  # "merge"
    merger: str  # the merge wrapped, e.g. "sglang.merge_state", "vllm.merge_attn_states"
    lse_base: str = "e"  # LSE_BASES: the base of the lse tensors the capture holds, as their producer wrote them

    def summary(self) -> str:
        return f"merger {self.merger}  lse base {self.lse_base}{self.where()}"


def merger_keys(raw: Any, path: Any, mode: str) -> dict:
    """The keys a merge kind's meta shares (``mode``, ``merger``, ``lse_base``), checked;
    CaptureError names the key."""
    if not isinstance(raw, dict):
        raise CaptureError(path, "header key 'meta'", "not a JSON object")
    if raw.get("mode") != mode:
        raise CaptureError(path, "meta key 'mode'", f"expected {mode!r}, got {raw.get('mode')!r}")
    if not isinstance(raw.get("merger"), str):
        raise CaptureError(path, "meta key 'merger'", "missing or not a string")
    base = lse_base_of(raw.get("lse_base", "e"))
    if base is None:
        raise CaptureError(path, "meta key 'lse_base'", f"expected one of {', '.join(LSE_BASE_ALIASES)} (e = ln, 2 = log2), "
                           f"got {raw.get('lse_base')!r}")  # fmt: skip
    return {"mode": mode, "merger": raw["merger"], "lse_base": MERGE_SPELLING[base]}


def parse_merge_meta(raw: Any, path: Any) -> MergeMeta:
    """The meta of a merge capture, every key checked; CaptureError names the key."""
    meta = MergeMeta(**merger_keys(raw, path, MODE))
    meta.read_common(raw, path)
    return meta


@dataclass
class MergeCapture(KindCapture):
    meta: MergeMeta
    out_a: torch.Tensor
    lse_a: torch.Tensor
    out_b: torch.Tensor
    lse_b: torch.Tensor
    out: torch.Tensor
    lse: Optional[torch.Tensor] = None
    len_a: Optional[torch.Tensor] = None
    len_b: Optional[torch.Tensor] = None

    def validate(self) -> None:
        validate(self)

    def empty(self, piece: str) -> torch.Tensor:
        """[T, H] bool: the piece has no keys at this (row, head) (lse -inf, len 0, or an all-zero output)."""
        lse, out, n = getattr(self, f"lse_{piece}"), getattr(self, f"out_{piece}"), getattr(self, f"len_{piece}")
        e = torch.isinf(lse) | (out == 0).all(dim=-1)
        if n is not None:
            e |= (n == 0)[:, None]
        return e


def validate(cap: MergeCapture) -> None:
    """Shapes, dtypes, finite outputs' shapes agree; CaptureError naming the first tensor that does not."""
    o = cap.out
    if o.dim() != 3 or o.dtype not in OUT_DTYPES:
        raise CaptureError(cap.path, "tensor 'out'", f"shape {list(o.shape)} {o.dtype}, expected [T, H, D] bf16 / fp16 / fp32")
    T, H, D = o.shape
    for name in ("out_a", "out_b"):
        t = getattr(cap, name)
        if list(t.shape) != [T, H, D] or t.dtype not in OUT_DTYPES:
            raise CaptureError(cap.path, f"tensor '{name}'", f"shape {list(t.shape)} {t.dtype}, expected [{T}, {H}, {D}] like out")
    for name in ("lse_a", "lse_b", "lse"):
        t = getattr(cap, name)
        if t is not None and (list(t.shape) != [T, H] or not t.dtype.is_floating_point):
            raise CaptureError(cap.path, f"tensor '{name}'", f"shape {list(t.shape)} {t.dtype}, expected [{T}, {H}] float")
    for name in ("len_a", "len_b"):
        t = getattr(cap, name)
        if t is not None and (list(t.shape) != [T] or t.dtype not in (torch.int32, torch.int64) or bool((t < 0).any())):
            raise CaptureError(cap.path, f"tensor '{name}'", f"expected [{T}] int32 / int64, none negative")
    for name in ("lse_a", "lse_b"):
        if bool(torch.isnan(getattr(cap, name)).any()):
            cap.warnings.append(f"{name} holds NaN (an empty piece merged with NaN instead of -inf?)")
    if not math.isfinite(float(cap.out.float().abs().sum())) and not cap.warnings:
        cap.warnings.append("out holds NaN / Inf")


def describe(cap: MergeCapture) -> dict:
    """What `refmla inspect` says of a merge capture: the merger, its lse base, the empty pieces."""
    T, H, D = cap.out.shape
    return {"merger": cap.meta.merger, "lse_base": cap.meta.lse_base, "rows": T, "heads": H, "dim": D,
            "empty_a": int(cap.empty("a").sum()), "empty_b": int(cap.empty("b").sum()),
            "empty_with_finite_lse": int(((cap.empty("a") & torch.isfinite(cap.lse_a)) |
                                          (cap.empty("b") & torch.isfinite(cap.lse_b))).sum()),
            "merged_lse": cap.lse is not None}  # fmt: skip


__all__ = ["LSE_BASES", "MODE", "TENSORS", "MergeCapture", "MergeMeta", "describe", "merger_keys", "parse_merge_meta", "validate"]
