"""Synthetic DeepSeek-V4 packed writer calls with a planted fault (``refmla synth OUT --preset
kv-write-v4 --fault ue8m0_exponent``): block-split pages of garbage bytes, shuffled slots, and a
writer of its own -- a plain loop over tokens and tiles that never calls refmla's reference
(its exponent from ``math.frexp``, its bytes placed by their own offsets) -- that stores each
token the documented way, or with the fault.

Faults: none, ue8m0_exponent (one tile's exponent one too big; a quantizing writer requantizes the
tile at it, a pack writer stores the given fp8 with the wrong byte), scale_missing (a quantizing
writer stores the latent without the tile scales), rope_offset (one token's rope bytes at byte 0
of its row), neighbour_slot (one token stored at its slot + 1), neighbour_overwritten (the slot
after one written slot zeroed), cast_overflow (an e4m3fnuz quantizing preset: every tile scaled for
e4m3fn's range, amax / 448, clamped to +-448 and cast by torch into e4m3fnuz: NaN from 248 up).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from refmla.kvwrite.io import write_kv_write
from refmla.util import check_choice

FAULTS = ("none", "ue8m0_exponent", "scale_missing", "rope_offset", "neighbour_slot", "neighbour_overwritten",
          "cast_overflow")  # fmt: skip
NOPE, ROPE, TILE, DATA, SCALE_ROW = 448, 64, 64, 576, 8  # the v4 token: 448 fp8 + 64 bf16; 7 exponents + pad


@dataclass(frozen=True)
class PackedSpec:
    name: str
    writer: str
    packed_input: str  # "latent" (the writer quantizes) | "pack" (it stores what it is given)
    kv_dtype: str = "float8_e4m3fn"
    amax_floor: float = 1e-4  # SGLang's CUDA store; 1e-8 its ROCm Triton store (and its test quantizer)
    page_size: int = 64
    pages: int = 4
    tokens: int = 8
    seed: int = 0


PRESETS = {
    "kv-write-v4": PackedSpec("kv-write-v4", "sglang.DeepSeekV4TokenToKVPool.set_swa_key_buffer_radix_fused", "latent"),
    "kv-write-v4-fnuz": PackedSpec("kv-write-v4-fnuz", "sglang.DeepSeekV4TokenToKVPool.set_swa_key_buffer_radix_fused",
                                   "latent", kv_dtype="float8_e4m3fnuz", amax_floor=1e-8),
    "kv-write-v4-c128": PackedSpec("kv-write-v4-c128", "sglang.DeepSeekV4TokenToKVPool.set_extra_key_buffer_fused",
                                   "latent", page_size=2, pages=64),
    "kv-write-v4-pack": PackedSpec("kv-write-v4-pack", "sglang.DeepSeekV4TokenToKVPool.set_swa_key_buffer", "pack",
                                   amax_floor=1e-8),
}  # fmt: skip


def _quantize_tile(vals: torch.Tensor, spec: PackedSpec, shift: int = 0, divide: bool = True,
                   range_of: str = "") -> tuple[torch.Tensor, int]:  # fmt: skip
    """One tile of 64 fp32 values -> (its fp8 bytes, its exponent byte), by hand (``range_of``: the
    fp8 whose largest value the scale and the clamp use, torch's cast into the pool's after)."""
    big = torch.finfo(getattr(torch, range_of or spec.kv_dtype)).max
    floor = float(torch.tensor(spec.amax_floor, dtype=torch.float32))
    amax = max(float(vals.abs().max()), floor)
    s = float(torch.tensor(amax, dtype=torch.float32) / torch.tensor(big, dtype=torch.float32))
    mant, k = math.frexp(s)  # s = mant * 2^k, 0.5 <= mant < 1
    power = (k - 1 if mant == 0.5 else k) + shift  # the smallest power of two >= s is 2^power
    q = vals * (2.0**-power) if divide else vals.clone()
    q = q.clamp(-big, big).to(getattr(torch, spec.kv_dtype)).view(torch.uint8)
    return q, power + 127


def _token(latent: torch.Tensor, rope: torch.Tensor, spec: PackedSpec, shift_tile: int = -1,
           divide: bool = True, range_of: str = "") -> tuple[torch.Tensor, torch.Tensor, list[int]]:  # fmt: skip
    nope, exps = [], []
    for j in range(NOPE // TILE):
        q, e = _quantize_tile(latent[j * TILE : (j + 1) * TILE].float(), spec, 1 if j == shift_tile else 0, divide,
                              range_of)  # fmt: skip
        nope.append(q)
        exps.append(e)
    return torch.cat(nope), rope.view(torch.uint8), exps


def _inputs(spec: PackedSpec, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Tiles of different magnitudes, one all zero and one below the amax floor (the floor matters)."""
    T = spec.tokens
    mag = torch.tensor([2.0, 0.03, 7.0, 1.0, 0.0, 1e-6, 300.0])
    latent = (torch.randn(T, NOPE // TILE, TILE, generator=g) * mag[:, None]).reshape(T, NOPE).to(torch.bfloat16)
    return latent, (torch.randn(T, ROPE, generator=g) * 3).to(torch.bfloat16)


def synth_packed(out: Any, preset: str, fault: str = "none", seed: int = 0) -> dict:
    """Write one packed kv_write capture; returns what was planted (token, slot, tile)."""
    check_choice("packed kv_write preset", preset, PRESETS)
    check_choice("packed kv_write fault", fault, FAULTS)
    spec = PRESETS[preset]
    if fault == "scale_missing" and spec.packed_input == "pack":
        raise ValueError("fault 'scale_missing' needs a quantizing preset (a pack writer stores scales it is given)")
    if fault == "cast_overflow" and (spec.packed_input == "pack" or spec.kv_dtype != "float8_e4m3fnuz"):
        raise ValueError("fault 'cast_overflow' needs an e4m3fnuz quantizing preset (kv-write-v4-fnuz)")
    g = torch.Generator().manual_seed(seed)
    latent, rope = _inputs(spec, g)
    ps, rows = spec.page_size, spec.page_size * spec.pages
    stride = -(-ps * (DATA + SCALE_ROW) // DATA) * DATA
    slots = (torch.randperm(rows // 3 - 2, generator=g)[: spec.tokens] * 3 + 2).to(torch.int64)
    pool = torch.randint(0, 256, (spec.pages * stride,), generator=g, dtype=torch.uint8)  # garbage, pads too
    before = pool.clone()
    victim, tile = spec.tokens // 2, 3
    packs = [_token(latent[t], rope[t], spec) for t in range(spec.tokens)]  # what a pack writer is given
    for t in range(spec.tokens):  # the writer: one token at a time
        bad = fault != "none" and t == victim
        if spec.packed_input == "latent":
            nope, rb, exps = _token(latent[t], rope[t], spec, tile if bad and fault == "ue8m0_exponent" else -1,
                                    divide=not (bad and fault == "scale_missing"),
                                    range_of="float8_e4m3fn" if fault == "cast_overflow" else "")  # fmt: skip
        else:
            nope, rb, exps = packs[t][0], packs[t][1], list(packs[t][2])
            exps[tile] += 1 if bad and fault == "ue8m0_exponent" else 0
        slot = int(slots[t]) + (1 if bad and fault == "neighbour_slot" else 0)
        page, off = divmod(slot, ps)
        data, scale = page * stride + off * DATA, page * stride + ps * DATA + off * SCALE_ROW
        pool[data : data + NOPE] = nope
        at = 0 if bad and fault == "rope_offset" else NOPE
        pool[data + at : data + at + 2 * ROPE] = rb
        pool[scale : scale + NOPE // TILE] = torch.tensor(exps, dtype=torch.uint8)
    if fault == "neighbour_overwritten":
        page, off = divmod(int(slots[victim]) + 1, ps)
        pool[page * stride + off * DATA : page * stride + (off + 1) * DATA] = 0
    keep = torch.unique(torch.cat([slots - 1, slots, slots + 1]).clamp(0, rows - 1))

    def rows_of(flat: torch.Tensor) -> torch.Tensor:
        out = []
        for s in keep.tolist():
            page, off = divmod(s, ps)
            d, sc = page * stride + off * DATA, page * stride + ps * DATA + off * SCALE_ROW
            out.append(torch.cat([flat[d : d + DATA], flat[sc : sc + SCALE_ROW]]))
        return torch.stack(out)

    tensors = {"slots": slots, "pool_slots": keep, "rows_before": rows_of(before), "rows_after": rows_of(pool)}
    if spec.packed_input == "latent":
        tensors.update(latent=latent, rope=rope)
    else:
        fp8 = getattr(torch, spec.kv_dtype)
        tensors.update(latent=torch.stack([p[0] for p in packs]).view(fp8), rope=rope,
                       tile_scales=torch.tensor([p[2] for p in packs], dtype=torch.uint8))  # fmt: skip
    meta = {"mode": "kv_write", "writer": spec.writer, "kv_dtype": spec.kv_dtype, "kv_lora_rank": NOPE,
            "qk_rope_head_dim": ROPE, "kv_layout": "v4", "packed_input": spec.packed_input, "page_size": ps,
            "layer_id": 0, "tp_rank": 0, "step": 0, "engine": "synth", "rids": ["synth-0"]}  # fmt: skip
    if spec.packed_input == "latent":
        meta["amax_floor"] = spec.amax_floor
    write_kv_write(out, tensors, meta)
    planted = fault not in ("none", "cast_overflow")  # cast_overflow: every token
    return {"fault": fault, "token": victim if planted else None, "slot": int(slots[victim]) if planted else None,
            "tile": tile if fault == "ue8m0_exponent" else None,
            **({"range_of": "float8_e4m3fn"} if fault == "cast_overflow" else {})}  # fmt: skip


__all__ = ["FAULTS", "PRESETS", "PackedSpec", "synth_packed"]
