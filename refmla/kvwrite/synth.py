"""Synthetic KV writer calls with a planted fault (``refmla synth OUT --preset kv-write-fp8 --fault
scale_missing``): a pool with NaN garbage in its unwritten rows, shuffled slots, and a writer of its
own -- a plain loop over tokens that never calls refmla's reference -- that stores each token's row
the documented way, or with the fault.

Faults: none, scale_missing, scale_inverted, rope_offset (rope stored at column 0), neighbour_slot
(one token's row stored at its slot + 1), neighbour_overwritten (the row after one slot zeroed),
saturated (a scale too small for the rope part: vLLM #42956). The bytes between writer and reader
(docs/kv-bytes.md): encoding_mismatch (every row stored in the other e4m3 encoding), cast_overflow
(e4m3fnuz: a scale too small and torch's own cast, NaN past the range), scale_format (the recorded
fp32 scale 0.0131 divided by as UE8M0: 2^-7), scale_other_value (divided by twice the scale),
tokens_not_written (one token skipped), rope_stale (one token's rope part left as it was),
stale_rows (every token written one slot back: a stale slot mapping).

DeepSeek-V4's packed pages (presets ``kv-write-v4*``, their faults also ``ue8m0_exponent``) are
written by refmla.kvwrite.packed_synth; :func:`synth_kv_write` hands those presets to it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from refmla.kvwrite import packed_synth
from refmla.kvwrite.io import write_kv_write
from refmla.util import check_choice

FAULTS = ("none", "scale_missing", "scale_inverted", "rope_offset", "neighbour_slot", "neighbour_overwritten",
          "saturated", "encoding_mismatch", "cast_overflow", "scale_format", "scale_other_value", "tokens_not_written",
          "rope_stale", "stale_rows")  # fmt: skip
FP8_FAULTS = ("scale_missing", "scale_inverted", "saturated", "encoding_mismatch", "cast_overflow", "scale_format",
              "scale_other_value")  # fmt: skip
FORMAT_SCALE, FORMAT_READ = 0.0131, 2.0**-7  # scale_format: the fp32 scale and its UE8M0 reading (rounded down)
OTHER_E4M3 = {"float8_e4m3fn": "float8_e4m3fnuz", "float8_e4m3fnuz": "float8_e4m3fn"}


@dataclass(frozen=True)
class KvWriteSpec:
    name: str
    kv_dtype: str  # the pool's dtype
    writer: str
    tokens: int = 8
    pool_rows: int = 96
    kv_lora_rank: int = 512  # DeepSeek-V3 / Kimi-K2
    qk_rope_head_dim: int = 64
    scale: float = 1.0
    seed: int = 0


PRESETS = {
    "kv-write-bf16": KvWriteSpec("kv-write-bf16", "bfloat16", "sglang.MLATokenToKVPool.set_mla_kv_buffer"),
    "kv-write-fp8": KvWriteSpec("kv-write-fp8", "float8_e4m3fn", "vllm.concat_and_cache_mla", scale=0.0625),
    "kv-write-fp8-fnuz": KvWriteSpec("kv-write-fp8-fnuz", "float8_e4m3fnuz",
                                     "aiter.fused_qk_rope_concat_and_cache_mla", scale=0.125),
}  # fmt: skip
ROW_PRESETS = dict(PRESETS)
PRESETS.update(packed_synth.PRESETS)  # type: ignore[arg-type]  # the packed presets (refmla.kvwrite.packed_synth)


def _store(row: torch.Tensor, spec: KvWriteSpec, scale: float, encoding: str = "", saturate: bool = True) -> torch.Tensor:
    """One token's row [D] fp32 -> the pool's dtype, the way the documented writers do it (or in
    ``encoding``'s bytes, or torch's own cast without saturation)."""
    dtype = getattr(torch, spec.kv_dtype)
    if not spec.kv_dtype.startswith("float8"):
        return row.to(dtype)
    enc = getattr(torch, encoding or spec.kv_dtype)
    big = torch.finfo(enc).max
    q = row / torch.tensor(scale, dtype=torch.float32)
    if saturate:
        q = torch.minimum(torch.maximum(q, torch.tensor(-big)), torch.tensor(big))
    return q.to(enc).view(torch.uint8).view(dtype)


def synth_kv_write(out: Any, preset: str, fault: str = "none", seed: int = 0) -> dict:
    """Write one kv_write capture; returns what was planted (tokens and slots)."""
    if preset in packed_synth.PRESETS:
        return packed_synth.synth_packed(out, preset, fault, seed)
    check_choice("kv_write preset", preset, PRESETS)
    check_choice("kv_write fault", fault, FAULTS)
    spec = PRESETS[preset]
    if fault in FP8_FAULTS and not spec.kv_dtype.startswith("float8"):
        raise ValueError(f"fault {fault!r} needs an fp8 preset (a {spec.kv_dtype} writer has no scale)")
    if fault == "cast_overflow" and spec.kv_dtype != "float8_e4m3fnuz":
        raise ValueError("fault 'cast_overflow' needs an e4m3fnuz preset (kv-write-fp8-fnuz): torch's e4m3fn cast saturates")
    g = torch.Generator().manual_seed(seed)
    L, R, T = spec.kv_lora_rank, spec.qk_rope_head_dim, spec.tokens
    dtype = getattr(torch, spec.kv_dtype)
    latent = (torch.randn(T, L, generator=g) * 2).to(torch.bfloat16)
    rope = (torch.randn(T, R, generator=g) * (60 if fault in ("saturated", "cast_overflow") else 2)).to(torch.bfloat16)
    slots = (torch.randperm(spec.pool_rows // 3 - 2, generator=g)[:T] * 3 + 2).to(torch.int64)  # apart: distinct neighbours
    pool = torch.randn(spec.pool_rows, L + R, generator=g).to(dtype)
    pool[0] = torch.tensor(float("nan")).to(dtype)  # garbage in a row nobody writes
    before = pool.clone()
    scale = {"saturated": 0.0625, "cast_overflow": 0.0625, "scale_format": FORMAT_SCALE}.get(fault, spec.scale)
    victim = T // 2
    for t in range(T):  # the writer: one token at a time
        if fault == "tokens_not_written" and t == victim:
            continue
        row = torch.cat([latent[t].float(), rope[t].float()])  # [D]
        use = {"scale_missing": 1.0, "scale_inverted": 1.0 / scale, "scale_format": FORMAT_READ,
               "scale_other_value": float(torch.tensor(scale) * 2)}.get(fault, scale)  # fmt: skip
        stored = _store(row, spec, use, OTHER_E4M3.get(spec.kv_dtype, "") if fault == "encoding_mismatch" else "",
                        saturate=fault != "cast_overflow")  # fmt: skip
        if fault == "rope_offset":
            stored = torch.cat([stored[L:], stored[R:L], stored[:R]]) if t == victim else stored
        if fault == "rope_stale" and t == victim:
            stored = torch.cat([stored[:L], pool[int(slots[t]), L:]])
        slot = int(slots[t]) + (1 if fault == "neighbour_slot" and t == victim else 0) - (fault == "stale_rows")
        pool[slot] = stored
    if fault == "neighbour_overwritten":
        pool[int(slots[victim]) + 1] = torch.zeros(L + R).to(dtype)
    keep = torch.unique(torch.cat([slots - 1, slots, slots + 1]).clamp(0, spec.pool_rows - 1))
    tensors = {"latent": latent, "rope": rope, "slots": slots, "pool_slots": keep, "rows_before": before[keep],
               "rows_after": pool[keep]}  # fmt: skip
    if spec.kv_dtype.startswith("float8"):
        tensors["scale"] = torch.tensor([scale], dtype=torch.float32)
    meta = {"mode": "kv_write", "writer": spec.writer, "kv_dtype": spec.kv_dtype, "kv_lora_rank": L,
            "qk_rope_head_dim": R, "scale_applied": "writer", "layer_id": 0, "tp_rank": 0, "step": 0,
            "engine": "synth", "rids": ["synth-0"]}  # fmt: skip
    write_kv_write(out, tensors, meta)
    return {"fault": fault, "token": victim if fault != "none" else None,
            "slot": int(slots[victim]) if fault != "none" else None}  # fmt: skip


__all__ = ["FAULTS", "PRESETS", "ROW_PRESETS", "KvWriteSpec", "synth_kv_write"]
