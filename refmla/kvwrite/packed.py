"""DeepSeek-V4's packed KV pages as a writer stores them (kv_write meta ``kv_layout`` ``v4``).

The layout is refmla.sparse.layouts' ``v4`` (its decoder is the one used here): a page holds
``page_size`` data rows of 576 bytes, then ``page_size`` scale rows of 8, its stride padded to a
multiple of 576. Slot ``s`` is token ``s % page_size`` of page ``s // page_size``:

    data row   page * stride + offset * 576:                 448 fp8 (7 tiles of 64) | 64 bf16 rope (128 bytes)
    scale row  page * stride + page_size * 576 + offset * 8: 7 UE8M0 exponents e (scale 2^(e - 127)) | 1 pad byte

A capture keeps each kept slot's 584 bytes as one row, its data row then its scale row
(:func:`token_columns`). No writer writes the pad byte: it keeps what it held.

What a writer is given (meta ``packed_input``):

    latent  (SGLang 0.5.23's fused_store_cache: the CUDA FusedStoreCacheFlashMLAKernel, on ROCm
            triton_fused_store_flashmla) [T, 512]: the writer quantizes, per tile of 64 (:func:`exponents`):
              s   = fp32(max(amax, floor)) / fp8_max in fp32 (floor: meta ``amax_floor``, 1e-4 CUDA,
                    1e-8 ROCm Triton; NaN elements do not count, as fmaxf)
              e   = the biased exponent of the smallest power of two >= s (s's exponent field, + 1
                    when its mantissa is not 0)
              fp8 = x * 2^(127 - e) in fp32, clamped to +-fp8_max (fminf / fmaxf: NaN -> +fp8_max),
                    rounded to nearest even; the rope part cast to bf16 (to nearest even)
    pack    (SetKAndS / _set_k_and_s_triton): ``k_nope_fp8`` [T, 448], ``k_rope_bf16`` [T, 64],
            ``scale_k_nope_ue8m0`` [T, 7] (tensors ``latent``, ``rope``, ``tile_scales``), stored as given
"""

from __future__ import annotations

from typing import Optional

import torch

from refmla.sparse.layouts import FP8_DTYPES, LAYOUTS, PackedLayout, dequantize

PACKED_LAYOUTS = ("v4",)  # the packed layouts a writer capture may hold (refmla.sparse.layouts)
PACKED_INPUTS = ("latent", "pack")
INPUT_DTYPES = {torch.bfloat16, torch.float16, torch.float32}


def layout_of(name: str) -> PackedLayout:
    return LAYOUTS[name]


def token_columns(offsets: torch.Tensor, layout: PackedLayout, page_size: int) -> torch.Tensor:
    """[N, bytes_per_token] int64: the bytes, inside their page, of the tokens at page ``offsets`` [N]
    (block-split pages: the data row, then the scale row)."""
    o = offsets.long()[:, None]
    data = o * layout.data_bytes + torch.arange(layout.data_bytes, device=o.device)
    scale = page_size * layout.data_bytes + o * layout.scale_bytes + torch.arange(layout.scale_bytes, device=o.device)
    return torch.cat([data, scale], dim=1)


def input_problem(cap) -> Optional[tuple[str, str]]:
    """(tensor, why) for the first input of a packed capture that is not what its writer is given."""
    m, lay = cap.meta, layout_of(cap.meta.kv_layout)
    T = cap.latent.shape[0]
    fp8 = FP8_DTYPES[m.kv_dtype]
    if m.packed_input == "pack":
        want = {"latent": ([T, lay.d_nope], {fp8}), "rope": ([T, lay.d_rope], {torch.bfloat16}),
                "tile_scales": ([T, lay.num_tiles], {torch.uint8})}  # fmt: skip
    else:
        want = {"latent": ([T, lay.d_nope], INPUT_DTYPES), "rope": ([T, lay.d_rope], INPUT_DTYPES)}
        if cap.tile_scales is not None:
            return "tile_scales", "given to a writer that quantizes (meta packed_input 'latent'): it computes its own"
    for name, (shape, dtypes) in want.items():
        t = getattr(cap, name)
        if t is None:
            return name, f"missing: a {m.packed_input!r} writer of the {m.kv_layout} layout is given it"
        if list(t.shape) != shape or t.dtype not in dtypes:
            names = " / ".join(sorted(str(d).replace("torch.", "") for d in dtypes))
            return name, f"shape {list(t.shape)} {t.dtype}, expected {shape} {names}"
    return None


# ---------------------------------------------------------------------------------------------
# The quantization, exactly
# ---------------------------------------------------------------------------------------------


def fp8_max(kv_dtype: str) -> float:
    return float(torch.finfo(FP8_DTYPES[kv_dtype]).max)


def exponents(nope: torch.Tensor, layout: PackedLayout, kv_dtype: str, floor: float) -> torch.Tensor:
    """[T, tiles] int64: each tile's UE8M0 exponent byte (module docstring), bit for bit."""
    x = nope.to(torch.float32).reshape(nope.shape[0], layout.num_tiles, layout.tile)
    amax = x.abs().nan_to_num(nan=0.0).amax(dim=-1)  # fmaxf skips NaN
    lo, big = torch.tensor(floor, dtype=torch.float32), torch.tensor(fp8_max(kv_dtype), dtype=torch.float32)
    s = torch.fmax(amax, lo) / big
    bits = s.contiguous().view(torch.int32).long()
    return (((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).long()) & 0xFF


def quantize_tiles(nope: torch.Tensor, e: torch.Tensor, layout: PackedLayout, kv_dtype: str) -> torch.Tensor:
    """[T, d_nope] uint8: the fp8 bytes of ``nope`` at the tiles' exponent bytes ``e`` [T, tiles]."""
    T = nope.shape[0]
    inv = ((254 - e.long()).to(torch.int32) << 23).contiguous().view(torch.float32)  # 2^(127 - e), as the kernel
    x = nope.to(torch.float32).reshape(T, layout.num_tiles, layout.tile) * inv[..., None]
    big = torch.tensor(fp8_max(kv_dtype), dtype=torch.float32)
    x = torch.fmax(torch.fmin(x, big), -big)
    return x.to(FP8_DTYPES[kv_dtype]).reshape(T, -1).contiguous().view(torch.uint8)


def rope_bytes(rope: torch.Tensor) -> torch.Tensor:
    return rope.to(torch.bfloat16).contiguous().view(torch.uint8).reshape(rope.shape[0], -1)


def sections(cap, e: Optional[torch.Tensor] = None, divide: bool = True) -> tuple[torch.Tensor, ...]:
    """(nope bytes [T, d_nope], rope bytes [T, 2 d_rope], exponent bytes [T, tiles]) a writer of this
    capture stores: the documented ones, or a latent writer's at exponents ``e`` / without dividing."""
    lay = layout_of(cap.meta.kv_layout)
    if cap.meta.packed_input == "pack":
        return cap.latent.contiguous().view(torch.uint8), rope_bytes(cap.rope), cap.tile_scales.to(torch.uint8)
    doc = exponents(cap.latent, lay, cap.meta.kv_dtype, cap.meta.amax_floor)
    at = doc if e is None else e
    nope = quantize_tiles(cap.latent, at if divide else torch.full_like(at, 127), lay, cap.meta.kv_dtype)
    return nope, rope_bytes(cap.rope), at.to(torch.uint8)


def assemble(cap, nope: torch.Tensor, rope: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """[T, bytes_per_token] uint8 token rows from their sections; the pad bytes as they were before."""
    lay = layout_of(cap.meta.kv_layout)
    pad = cap.rows_before[cap.positions(), lay.data_bytes + lay.num_tiles :]
    return torch.cat([nope, rope, e.to(torch.uint8), pad], dim=1)


def written_rows(cap) -> torch.Tensor:
    """[T, bytes_per_token] uint8: what each token's 584 bytes hold after the documented writer."""
    return assemble(cap, *sections(cap))


def written_width(cap) -> int:
    """The bytes of a token row its writer writes (all but the pad)."""
    lay = layout_of(cap.meta.kv_layout)
    return lay.data_bytes + lay.num_tiles


def row_values(rows: torch.Tensor, cap) -> torch.Tensor:
    """fp64 [N, 512]: token rows decoded by refmla.sparse.layouts (each row a page of one token)."""
    return dequantize(rows.contiguous(), layout_of(cap.meta.kv_layout), 1, cap.meta.kv_dtype)


def describe_packed(cap) -> dict:
    """`refmla inspect`'s words for a packed capture's layout."""
    m, lay = cap.meta, layout_of(cap.meta.kv_layout)
    pages = sorted({int(s) // m.page_size for s in cap.slots.tolist()})
    return {"kv_layout": m.kv_layout, "packed_input": m.packed_input, "page_size": m.page_size,
            "amax_floor": m.amax_floor, "row_bytes": lay.bytes_per_token, "tiles_per_token": lay.num_tiles,
            "tile": lay.tile, "pages_written": pages[:16], "pages_written_count": len(pages)}  # fmt: skip


__all__ = ["INPUT_DTYPES", "PACKED_INPUTS", "PACKED_LAYOUTS", "assemble", "describe_packed", "exponents", "fp8_max",
           "input_problem", "layout_of", "quantize_tiles", "rope_bytes", "row_values", "sections", "token_columns",
           "written_rows", "written_width"]  # fmt: skip
