"""The rows a KV writer must store, exactly: the one quantization every writer documents.

    row = cat(latent, rope)                          [T, D], as the writer got them
    bf16 / fp16 / fp32 pool:  row cast to the pool's dtype (round to nearest even)
    fp8 pool (e4m3fn, e4m3fnuz, e5m2):  fp32(row) / fp32(scale), saturated to the format's largest
                              finite value, rounded to nearest even (vLLM's ``scaled_convert``,
                              aiter's quantize, SGLang's cast: ``x.to(fp8)``, its caller divided)

:func:`written_rows` takes the variants the hypotheses try (the scale not applied, applied
inverted, another scale, another fp8 encoding, torch's own cast without saturation: NaN past the
range on e4m3fnuz) as a :class:`Variant`, so there is one writer model. A packed capture (meta
``kv_layout``) has its own exact rule, per tile (refmla.kvwrite.packed): its documented token rows
come from there, and its saturation is none (each tile's scale covers its amax).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from refmla.kvwrite import packed
from refmla.kvwrite.format import FP8, KvWriteCapture


@dataclass(frozen=True)
class Variant:
    """How a writer may have gone wrong; the default is the documented writer."""

    scale: str = "divide"  # "divide" (documented) | "none" (scale not applied) | "multiply" (inverted)
    ratio: float = 1.0  # the scale the writer used, as a multiple of the one it was given
    scale_used: Optional[float] = None  # ... or outright (the given scale's bytes read as bf16 / UE8M0)
    encoding: Optional[str] = None  # the fp8 the row was stored in (None: the pool's meta kv_dtype)
    cast: str = "saturate"  # "saturate" (documented) | "torch": torch's own x.to(fp8), NaN past range on fnuz


DOCUMENTED = Variant()


def fp8_max(kv_dtype: str) -> float:
    return float(torch.finfo(getattr(torch, kv_dtype)).max)


def is_fp8(kv_dtype: str) -> bool:
    return kv_dtype.startswith("float8")


def scaled_input(cap: KvWriteCapture, variant: Variant = DOCUMENTED) -> torch.Tensor:
    """fp32 [T, D]: the row before rounding, the scale applied the variant's way."""
    parts = [cap.latent] + ([cap.rope] if cap.rope is not None and cap.rope.numel() else [])
    x = torch.cat([p.to(torch.float32) for p in parts], dim=1)  # [T, D]
    if cap.meta.kv_dtype not in FP8:
        return x
    given = cap.scale_value() if variant.scale_used is None else variant.scale_used
    s = torch.tensor(given, dtype=torch.float32) * variant.ratio
    return {"divide": x / s, "none": x, "multiply": x * s}[variant.scale]


def written_rows(cap: KvWriteCapture, variant: Variant = DOCUMENTED) -> torch.Tensor:
    """[T, D] in the pool's dtype: what each token's row holds after a writer of this variant
    (packed: the documented writer's token bytes, refmla.kvwrite.packed)."""
    if cap.meta.packed:
        return packed.written_rows(cap)
    x = scaled_input(cap, variant)
    dtype = variant.encoding or cap.meta.kv_dtype
    if is_fp8(dtype) and variant.cast == "saturate":
        m = fp8_max(dtype)
        x = x.clamp(-m, m)  # saturate (NaN stays NaN)
    return x.to(getattr(torch, dtype))  # [T, D]


def saturated(cap: KvWriteCapture) -> dict[str, int]:
    """fp8 only: elements whose scaled value lies past the format's range, per part ({} if none)."""
    if cap.meta.kv_dtype not in FP8 or cap.meta.packed:
        return {}
    over = scaled_input(cap).abs() > fp8_max(cap.meta.kv_dtype)  # [T, D]
    L = cap.meta.kv_lora_rank
    counts = {"latent": int(over[:, :L].sum()), "rope": int(over[:, L:].sum())}
    return {k: v for k, v in counts.items() if v}


def expected_pool(cap: KvWriteCapture, rows: torch.Tensor) -> torch.Tensor:
    """[N, D]: the kept rows before the write with each token's row stored at its slot."""
    out = cap.rows_before.clone()
    out[cap.positions()] = rows
    return out


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[N] bool: rows equal bit for bit (NaN equal to the same NaN)."""
    return (a.contiguous().view(torch.uint8) == b.contiguous().view(torch.uint8)).all(dim=-1)


__all__ = ["DOCUMENTED", "Variant", "expected_pool", "fp8_max", "is_fp8", "same_bytes", "saturated", "scaled_input",
           "written_rows"]  # fmt: skip
