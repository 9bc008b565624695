"""The packed fp8 KV layouts DeepSeek's sparse MLA kernels read, decoded exactly in fp64.

Two layouts, as FlashMLA (``tests/quant.py``, ``flash_mla_interface.py``) and SGLang 0.5.23
(``sglang/kernels/ops/attention/dsv4/kv_layout.py``) define them, per token:

    v32  DeepSeek-V3.2 (FlashMLA V32_FP8Sparse), 656 bytes, one token's bytes contiguous:
             [0, 512)    512 fp8 e4m3 (the latent, 4 tiles of 128)
             [512, 528)  4 fp32 scales, one per tile (powers of two: FlashMLA casts amax/448 to UE8M0)
             [528, 656)  64 bf16 rope
         value = fp8 * scale;  D = 576, the value width Dv = 512 (the latent)
    v4   DeepSeek-V4 (FlashMLA MODEL1_FP8Sparse, SGLang KVLayout.V4), 584 bytes, block-split pages:
             a page is page_size data rows of 576 bytes, then page_size scale rows of 8 bytes,
             the page stride padded to a multiple of 576;
             data  [0, 448) 448 fp8 e4m3 (7 tiles of 64), [448, 576) 64 bf16 rope
             scale [0, 7)   7 UE8M0 exponents e (scale 2^(e - 127)), [7] padding
         value = fp8 * 2^(e - 127);  D = 512, Dv = 512 (the rope section is part of the value)

Token ``t`` of a cache is ``page * page_size + offset`` (the kernels' flat token index). fp8 is
OCP e4m3fn on gfx950 / CUDA and e4m3fnuz on gfx942 (meta ``kv_fp8_dtype``; e5m2 is read too).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

FP8_DTYPES = {"float8_e4m3fn": torch.float8_e4m3fn, "float8_e4m3fnuz": torch.float8_e4m3fnuz,
              "float8_e5m2": torch.float8_e5m2}  # fmt: skip
FP8_MAX = {"float8_e4m3fn": 448.0, "float8_e4m3fnuz": 240.0, "float8_e5m2": 57344.0}


@dataclass(frozen=True)
class PackedLayout:
    name: str  # "v4" | "v32"
    d_nope: int  # fp8 values per token
    d_rope: int  # bf16 values per token
    tile: int  # values sharing one scale
    scale_kind: str  # "ue8m0" (one exponent byte) | "fp32"
    scale_bytes: int  # scale bytes per token, padding included
    block_split: bool  # True: page_size data rows, then page_size scale rows (v4); False: token-contiguous
    page_align: int  # the page stride is padded to a multiple of this many bytes
    d_v: int  # value width the kernel returns

    @property
    def num_tiles(self) -> int:
        return self.d_nope // self.tile

    @property
    def head_dim(self) -> int:
        return self.d_nope + self.d_rope

    @property
    def data_bytes(self) -> int:
        """fp8 + rope bytes of one token (v4's data row; v32 keeps its scales between them)."""
        return self.d_nope + 2 * self.d_rope

    @property
    def bytes_per_token(self) -> int:
        return self.data_bytes + self.scale_bytes

    def page_bytes(self, page_size: int) -> int:
        """The page stride: page_size tokens, padded to page_align."""
        return -(-page_size * self.bytes_per_token // self.page_align) * self.page_align


LAYOUTS = {
    "v4": PackedLayout("v4", d_nope=448, d_rope=64, tile=64, scale_kind="ue8m0", scale_bytes=8,
                       block_split=True, page_align=576, d_v=512),
    "v32": PackedLayout("v32", d_nope=512, d_rope=64, tile=128, scale_kind="fp32", scale_bytes=16,
                        block_split=False, page_align=656, d_v=512),
}  # fmt: skip
assert LAYOUTS["v4"].bytes_per_token == 584 and LAYOUTS["v32"].bytes_per_token == 656


@dataclass(frozen=True)
class TokenBytes:
    """One cache's bytes cut into its three sections, per token (uint8 views, no copies)."""

    nope: torch.Tensor  # [N, d_nope]
    scales: torch.Tensor  # [N, scale_bytes]
    rope: torch.Tensor  # [N, 2 * d_rope]


def token_bytes(cache: torch.Tensor, layout: PackedLayout, page_size: int) -> TokenBytes:
    """Cut ``cache`` [P, page stride] uint8 into per-token sections ([P * page_size, ...])."""
    P = cache.shape[0]
    n = P * page_size
    if layout.block_split:
        data = cache[:, : page_size * layout.data_bytes].reshape(P, page_size, layout.data_bytes)
        scale_end = page_size * layout.bytes_per_token
        scales = cache[:, page_size * layout.data_bytes : scale_end].reshape(P, page_size, layout.scale_bytes)
        return TokenBytes(data[..., : layout.d_nope].reshape(n, -1), scales.reshape(n, -1),
                          data[..., layout.d_nope :].reshape(n, -1))  # fmt: skip
    tok = cache[:, : page_size * layout.bytes_per_token].reshape(n, layout.bytes_per_token)
    s0 = layout.d_nope
    return TokenBytes(tok[:, :s0], tok[:, s0 : s0 + layout.scale_bytes], tok[:, s0 + layout.scale_bytes :])


def token_rows(cache: torch.Tensor, layout: PackedLayout, page_size: int) -> torch.Tensor:
    """Each token's packed bytes as one row, [P * page_size, bytes_per_token] uint8 (a copy), its
    sections in the order of :func:`sections` (v4's data row, then its scale row): what a transfer
    of the cache carries, compared exactly by diff-kv."""
    b = token_bytes(cache.view(torch.uint8), layout, page_size)
    return torch.cat([b.nope, b.rope, b.scales], dim=1)


def sections(layout: PackedLayout) -> dict[str, tuple[int, int]]:
    """Byte ranges [start, end) of a :func:`token_rows` row: the fp8 values, the bf16 rope, the scales."""
    n, r = layout.d_nope, 2 * layout.d_rope
    return {"nope": (0, n), "rope": (n, n + r), "scales": (n + r, n + r + layout.scale_bytes)}


def row_sections(rows: torch.Tensor, layout: PackedLayout) -> TokenBytes:
    """:func:`token_rows` rows [N, bytes_per_token] cut back into their sections (views)."""
    (a, b), (c, d), (e, f) = sections(layout).values()
    return TokenBytes(nope=rows[:, a:b], scales=rows[:, e:f], rope=rows[:, c:d])


def rows_to_pages(rows: torch.Tensor, layout: PackedLayout, page_size: int) -> torch.Tensor:
    """The inverse of :func:`token_rows`: rows [N, bytes_per_token] (N a multiple of page_size) as pages."""
    b = row_sections(rows, layout)
    return pack_pages(b.nope, b.scales, b.rope, layout, page_size)


def tile_scales(b: TokenBytes, layout: PackedLayout) -> torch.Tensor:
    """The per-tile scales in fp64 [N, num_tiles]: 2^(e - 127) (UE8M0, e = 255 is NaN) or the fp32 values."""
    if layout.scale_kind == "ue8m0":
        e = b.scales[:, : layout.num_tiles].to(torch.float64)
        return torch.where(e == 255, torch.full_like(e, math.nan), torch.exp2(e - 127.0))
    return b.scales[:, : 4 * layout.num_tiles].contiguous().view(torch.float32).to(torch.float64)


def dequantize(cache: torch.Tensor, layout: PackedLayout, page_size: int, fp8: str = "float8_e4m3fn",
               tokens: Optional[torch.Tensor] = None) -> torch.Tensor:  # fmt: skip
    """The tokens of ``cache`` [P, page stride] uint8 (all, or ``tokens`` [n] flat indices) in fp64
    [n, D] (exact: fp8 x a power-of-two or fp32 scale, and the bf16 rope, are representable in fp64)."""
    b = token_bytes(cache.view(torch.uint8), layout, page_size)
    if tokens is not None:
        b = TokenBytes(b.nope[tokens], b.scales[tokens], b.rope[tokens])
    return token_values(b, layout, fp8)


def token_values(b: TokenBytes, layout: PackedLayout, fp8: str = "float8_e4m3fn") -> torch.Tensor:
    """Tokens cut into their sections -> their values in fp64 [N, D] (exact)."""
    nope = b.nope.contiguous().view(FP8_DTYPES[fp8]).to(torch.float64)  # [N, d_nope]
    scales = tile_scales(b, layout).repeat_interleave(layout.tile, dim=1)  # [N, d_nope]
    rope = b.rope.contiguous().view(torch.bfloat16).to(torch.float64)  # [N, d_rope]
    return torch.cat([nope * scales, rope], dim=1)  # [N, D]


def ue8m0_scale(amax: torch.Tensor, fp8_max: float) -> torch.Tensor:
    """The power-of-two scale >= amax / fp8_max (FlashMLA's: 2^ceil(log2(max(amax / fp8_max, 1e-4))))."""
    return torch.exp2(torch.ceil(torch.log2(torch.clamp_min(amax / fp8_max, 1e-4))))


def quantize(k: torch.Tensor, layout: PackedLayout, page_size: int, fp8: str = "float8_e4m3fn") -> torch.Tensor:
    """Pack ``k`` [N, D] (N a multiple of page_size) into [N / page_size, page stride] uint8 pages
    (padding zero): per tile a power-of-two scale from its amax, the rope rounded to bf16."""
    return quantize_with_values(k, layout, page_size, fp8)[0]


def quantize_with_values(k: torch.Tensor, layout: PackedLayout, page_size: int, fp8: str = "float8_e4m3fn",
                         amax_scales: bool = False) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(pages, the values they hold in fp64 [N, D]), the values from the quantizer's own fp8 numbers
    and scales (not decoded back from the bytes): what synth plants with. ``amax_scales`` (fp32
    layouts): each tile's scale amax / fp8_max in fp32 (SGLang's V3.2 store), not a power of two."""
    N, D = k.shape
    assert D == layout.head_dim and N % page_size == 0, (k.shape, layout.name, page_size)
    x = k.to(torch.float64)
    tiles = x[:, : layout.d_nope].reshape(N, layout.num_tiles, layout.tile)
    if amax_scales and layout.scale_kind == "fp32":
        s32 = tiles.to(torch.float32).abs().amax(dim=-1) / FP8_MAX[fp8]  # [N, tiles] fp32
        q = (tiles.to(torch.float32) * (1.0 / s32)[..., None]).clamp(-FP8_MAX[fp8], FP8_MAX[fp8])
        scale = s32.double()
    else:
        scale = ue8m0_scale(tiles.abs().amax(dim=-1), FP8_MAX[fp8])  # [N, tiles]
        q = (tiles / scale[..., None]).to(torch.float32)
    q8 = q.to(FP8_DTYPES[fp8]).reshape(N, -1).view(torch.uint8)
    rope = x[:, layout.d_nope :].to(torch.bfloat16).view(torch.uint8).reshape(N, -1)
    if layout.scale_kind == "ue8m0":
        sb = torch.zeros(N, layout.scale_bytes, dtype=torch.uint8)
        sb[:, : layout.num_tiles] = (torch.log2(scale) + 127).round().to(torch.uint8)
    else:
        sb = scale.to(torch.float32).contiguous().view(torch.uint8).reshape(N, -1)
    values = torch.cat([(q8.view(FP8_DTYPES[fp8]).to(torch.float64).reshape(N, layout.num_tiles, -1)
                         * scale[..., None]).reshape(N, -1), x[:, layout.d_nope :].to(torch.bfloat16).double()], 1)
    return pack_pages(q8, sb, rope, layout, page_size), values


def pack_pages(nope: torch.Tensor, scales: torch.Tensor, rope: torch.Tensor, layout: PackedLayout,
               page_size: int) -> torch.Tensor:  # fmt: skip
    """Lay per-token sections ([N, ...] uint8) out as pages [N / page_size, page stride]."""
    N = nope.shape[0]
    P = N // page_size
    pages = torch.zeros(P, layout.page_bytes(page_size), dtype=torch.uint8)
    if layout.block_split:
        data = torch.cat([nope, rope], dim=1).reshape(P, page_size * layout.data_bytes)
        pages[:, : data.shape[1]] = data
        pages[:, data.shape[1] : data.shape[1] + page_size * layout.scale_bytes] = scales.reshape(P, -1)
    else:
        tok = torch.cat([nope, scales, rope], dim=1).reshape(P, page_size * layout.bytes_per_token)
        pages[:, : tok.shape[1]] = tok
    return pages


__all__ = ["FP8_DTYPES", "LAYOUTS", "PackedLayout", "TokenBytes", "dequantize", "pack_pages", "quantize", "quantize_with_values",
           "row_sections", "rows_to_pages", "sections", "tile_scales", "token_bytes", "token_rows", "token_values",
           "ue8m0_scale"]  # fmt: skip
