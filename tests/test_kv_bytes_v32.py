"""DeepSeek-V3.2's sparse cache (656-byte rows: 512 fp8, 4 fp32 tile scales, 64 bf16 rope) read
another way than SGLang wrote it: the fp32 tile scales read as UE8M0 or bf16 (``kv_scale_format``),
the fp8 bytes in another encoding (refmla.sparse.readings).

Test data: the pages are SGLang's own V3.2 NSA fp8 store (``dsa_quant_k_cache.quantize_k_cache``,
its Triton kernel in the interpreter: scale = amax / 448 in fp32, not a power of two); the index
lists are refmla's synthetic V3.2 case (inputs only). The "kernel" is this file's: the fp8 bytes by
torch's own fp8 view, the scales by this file's bit arithmetic (struct), a plain fp64 softmax."""

from __future__ import annotations

import dataclasses
import math
import struct

import pytest
import torch

import sglang_kit
from refmla.options import ReplayOptions
from refmla.pipeline import replay_file
from refmla.sparse.presets import sparse_preset
from refmla.sparse.synth import build_case
from refmla.sparse.validation import write_sparse


def _bits(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", x))[0]


def _f32(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits & 0xFFFFFFFF))[0]


READERS = {  # how a kernel takes the 4 fp32 scales' 16 bytes: (scales as floats, their raw bytes) -> tile t's scale
    "fp32": lambda s, raw, t: s[t],
    "ue8m0 down": lambda s, raw, t: 2.0 ** (((_bits(s[t]) >> 23) & 0xFF) - 127),
    "ue8m0 up": lambda s, raw, t: 2.0 ** (((_bits(s[t]) >> 23) & 0xFF) - 127 + (1 if _bits(s[t]) & 0x7FFFFF else 0)),
    "ue8m0 bytes": lambda s, raw, t: 2.0 ** (raw[t] - 127),  # a V4 reader: byte t is tile t's exponent
    "bf16 low": lambda s, raw, t: _f32((_bits(s[t]) & 0xFFFF) << 16),
}


@pytest.fixture(scope="module")
def case():
    """The synthetic V3.2 call with its pages replaced by SGLang's store of bf16 latents."""
    try:
        sglang_kit.prepare()
        from sglang.kernels.ops.quantization.dsa_quant_k_cache import quantize_k_cache
    except (sglang_kit.Unavailable, ImportError) as e:
        pytest.skip(f"SGLang's V3.2 fp8 store not importable: {e}")
    c = build_case(dataclasses.replace(sparse_preset("deepseek-v3.2-tp8"), seq_lens=(40, 130, 75)))
    P, page = c.main.pages.shape[0], c.main.page_size
    g = torch.Generator().manual_seed(7)
    k = torch.randn(P, page, 1, 576, generator=g) * torch.linspace(0.3, 3.0, 576)  # tiles of different amax
    pages = quantize_k_cache(k.bfloat16()).view(torch.uint8).reshape(P, page * 656)
    return dataclasses.replace(c, main=dataclasses.replace(c.main, pages=pages.contiguous()))


def token(pages: torch.Tensor, page: int, t: int, reader: str) -> torch.Tensor:
    """Token t's 576 values as the kernel reads them: fp8 by torch's view, scales by ``reader``."""
    row = pages[t // page, (t % page) * 656 : (t % page + 1) * 656]
    raw = row[512:528].tolist()
    s = [struct.unpack("<f", bytes(raw[4 * i : 4 * i + 4]))[0] for i in range(4)]
    nope = row[:512].contiguous().view(torch.float8_e4m3fn).double()
    scale = torch.tensor([READERS[reader](s, raw, i) for i in range(4)], dtype=torch.float64).repeat_interleave(128)
    rope = row[528:].contiguous().view(torch.bfloat16).double()
    return torch.cat([nope * scale, rope])


def kernel(case, reader: str) -> tuple[torch.Tensor, torch.Tensor]:
    p = case.preset
    B, _, H, _ = case.q.shape
    out = torch.zeros(B, 1, H, p.head_dim_v, dtype=torch.float64)
    lse = torch.full((B, 1, H), math.inf, dtype=torch.float64)
    for b in range(B):
        idx = [int(i) for i in case.indices[b, 0, : int(case.topk_length[b])] if int(i) >= 0]
        k = torch.stack([token(case.main.pages, case.main.page_size, i, reader) for i in idx])  # [n, 576]
        w = case.q[b, 0].double() @ k.T * p.softmax_scale  # [H, n]
        lse[b, 0] = torch.logsumexp(w, -1)
        out[b, 0] = torch.softmax(w, -1) @ k[:, : p.head_dim_v]
    return out.to(torch.bfloat16), lse.float()


def run(tmp_path, case, reader: str):
    out, lse = kernel(case, reader)
    path = tmp_path / f"v32-{reader.replace(' ', '-')}.safetensors"
    write_sparse(path, {**case.tensors(), "out": out, "lse": lse}, case.meta())
    return replay_file(str(path), ReplayOptions(backends=["reference", "observed"]))


def test_sglangs_fp32_scales_are_not_powers_of_two(case):
    s = case.main.pages.reshape(-1, 656)[:, 512:528].contiguous().view(torch.float32)
    assert bool((torch.frexp(s).mantissa != 0.5).any())  # so reading them as UE8M0 changes them


def test_the_kernel_reading_sglangs_scales_as_fp32_agrees(tmp_path, case):
    r = run(tmp_path, case, "fp32")
    assert r.verdict == "agree", r.diagnosis_text


@pytest.mark.parametrize("reader,read,how", [
    ("ue8m0 down", "ue8m0", "its exponent (rounded down to a power of two)"),
    ("ue8m0 up", "ue8m0", "rounded up to a power of two"),
    ("ue8m0 bytes", "ue8m0", "its bytes as UE8M0 exponents, one byte a tile"),
    ("bf16 low", "bf16", "its low half"),
])  # fmt: skip
def test_fp32_tile_scales_read_as_another_format_are_named(tmp_path, case, reader, read, how):
    r = run(tmp_path, case, reader)
    e = r.backends["observed"].explanation
    assert r.verdict == "diverged" and e is not None and e.hypothesis == "kv_scale_format", r.diagnosis_text
    assert e.detail == {"stored": "fp32", "read": read, "how": how, "cache": "main"}
    assert r.diagnosis == "kv_contract" and r.diagnosis_text.startswith("kv_scale_format")
