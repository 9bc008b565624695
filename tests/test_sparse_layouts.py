"""The packed fp8 layouts (refmla.sparse.layouts): round trip, byte positions, and an independent
byte-by-byte decoder written here (bit-level e4m3 / bf16 / fp32 decoding, no torch dtype views)."""

from __future__ import annotations

import math
import struct

import pytest
import torch

from refmla.sparse.layouts import LAYOUTS, dequantize, quantize


def e4m3fn(byte: int) -> float:
    """OCP e4m3fn by its bits: bias 7, no infinities, S.1111.111 is NaN."""
    s, e, m = byte >> 7, (byte >> 3) & 0xF, byte & 0x7
    if e == 0xF and m == 0x7:
        return math.nan
    v = (m / 8) * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
    return -v if s else v


def bf16(lo: int, hi: int) -> float:
    return struct.unpack("<f", bytes([0, 0, lo, hi]))[0]


def decode_token(page: bytes, page_size: int, slot: int, name: str) -> list[float]:
    """Token ``slot`` of one page, read byte by byte as the layouts' docs say."""
    if name == "v4":
        data, sc = page[slot * 576 : slot * 576 + 576], page[page_size * 576 + slot * 8 :][:8]
        nope = [e4m3fn(data[i]) * 2.0 ** (sc[i // 64] - 127) for i in range(448)]
        rope = [bf16(data[448 + 2 * i], data[449 + 2 * i]) for i in range(64)]
        return nope + rope
    tok = page[slot * 656 : slot * 656 + 656]
    scales = struct.unpack("<4f", tok[512:528])
    nope = [e4m3fn(tok[i]) * scales[i // 128] for i in range(512)]
    return nope + [bf16(tok[528 + 2 * i], tok[529 + 2 * i]) for i in range(64)]


@pytest.mark.parametrize("name,page_size", [("v4", 64), ("v4", 2), ("v32", 64)])
def test_quantize_then_dequantize_matches_an_independent_decoder(name, page_size):
    L = LAYOUTS[name]
    g = torch.Generator().manual_seed(3)
    N = 2 * page_size
    k = torch.randn(N, L.head_dim, generator=g, dtype=torch.float64) * torch.logspace(-3, 2, L.head_dim, dtype=torch.float64)
    pages = quantize(k, L, page_size)
    assert pages.shape == (2, L.page_bytes(page_size)) and pages.dtype == torch.uint8
    got = dequantize(pages, L, page_size)
    for t in (0, 1, N - 1):
        p, s = divmod(t, page_size)
        want = torch.tensor(decode_token(bytes(pages[p].tolist()), page_size, s, name), dtype=torch.float64)
        assert torch.equal(got[t], want), (name, t)
    # round trip: within fp8's half-ulp per tile (3 mantissa bits) and bf16 for the rope
    rel = (got[:, : L.d_nope] - k[:, : L.d_nope]).abs().amax(dim=1) / k[:, : L.d_nope].abs().amax(dim=1)
    assert float(rel.max()) < 2.0**-3
    assert torch.equal(got[:, L.d_nope :], k[:, L.d_nope :].to(torch.bfloat16).double())


def test_byte_counts_and_page_padding():
    assert LAYOUTS["v4"].bytes_per_token == 584 and LAYOUTS["v32"].bytes_per_token == 656
    assert LAYOUTS["v4"].page_bytes(64) == 37440  # SGLang's C4 page (64 rows): 37376 padded to 576
    assert LAYOUTS["v4"].page_bytes(2) == 1728  # its C128 page (2 rows)
    assert LAYOUTS["v4"].page_bytes(256) == 260 * 576  # 149504 bytes of tokens, padded
    assert LAYOUTS["v32"].page_bytes(64) == 64 * 656


def test_a_ue8m0_exponent_off_by_one_is_a_factor_of_two_on_one_tile():
    L = LAYOUTS["v4"]
    k = torch.randn(64, 512, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    pages = quantize(k, L, 64)
    base = dequantize(pages, L, 64)
    bad = pages.clone()
    bad[0, 64 * 576 + 5 * 8 + 3] += 1  # token 5, tile 3
    got = dequantize(bad, L, 64)
    diff = (got != base).nonzero()
    assert diff[:, 0].unique().tolist() == [5] and diff[:, 1].min() >= 192 and diff[:, 1].max() < 256
    assert torch.equal(got[5, 192:256], 2 * base[5, 192:256])


def test_padding_and_unused_bytes_are_not_read():
    L = LAYOUTS["v4"]
    k = torch.randn(2, 512, dtype=torch.float64)
    pages = quantize(k, L, 2)
    junk = pages.clone()
    junk[:, 2 * 584 :] = 0xFF  # the page padding
    junk[:, 2 * 576 + 7] = 0xFF  # token 0's pad byte after its 7 scales
    assert torch.equal(dequantize(junk, L, 2), dequantize(pages, L, 2))
