"""The KV bytes read another way than they were written, in a decode capture: an fp8 pool read in
the other encoding, its fp32 scale read as bf16 or UE8M0 (refmla.hypotheses.kv_bytes).

Test data: vLLM's layout by tools/planting_vllm.py's own loop (an e4m3fn cache of value / k_scale,
attention by a plain per-request softmax in fp64). The "kernel" reads the captured bytes with
torch's own fp8 views (``cache.view(torch.uint8).view(float8_e4m3fnuz)``) or a scale decoded by this
file's byte arithmetic; refmla's reference is never used to plant."""

from __future__ import annotations

import dataclasses
import struct

import pytest
import torch

from helpers import load_tool
from refmla.capture import read_capture, write_capture
from refmla.options import ReplayOptions
from refmla.pipeline import replay_capture

pv = load_tool("planting_vllm")
SPEC = pv.VllmSpec(block=16, fp8=True, seq_lens=(70, 33, 141), heads=2)


def replay(tmp_path, t, spec=SPEC):
    cap = read_capture(write_capture(tmp_path / "c.safetensors", t, pv.meta(spec), compact=False))
    return replay_capture(cap, ReplayOptions(backends=["reference"]))


def test_a_clean_fp8_capture_agrees(tmp_path):
    t, _, _ = pv.capture(SPEC)
    assert replay(tmp_path, t).verdict == "agree"


@pytest.mark.parametrize("read", [torch.float8_e4m3fnuz, torch.float8_e5m2])
def test_an_e4m3fn_cache_read_in_another_encoding_is_named_with_both(tmp_path, read):
    t, _, _ = pv.capture(SPEC)
    as_read = {**t, "kv_buffer": t["kv_buffer"].view(torch.uint8).view(read)}
    out, lse = pv.attention(as_read, SPEC)  # the kernel's view of the bytes
    t["out"], t["lse"] = out.to(torch.bfloat16), lse.float()
    r = replay(tmp_path, t)
    e = r.backends["observed"].explanation
    assert r.verdict == "diverged" and e is not None and e.hypothesis == "kv_fp8_encoding_mismatch", r.diagnosis_text
    assert e.detail == {"written": "float8_e4m3fn", "read": str(read).replace("torch.", "")}
    assert "kv_fp8_encoding_mismatch" in r.diagnosis_text


def bf16_low(x: float) -> float:
    """The fp32's first two bytes (little-endian: its low half) as a bf16: a kernel given the fp32
    scale tensor's pointer as bf16*."""
    bits = struct.unpack("<I", struct.pack("<f", x))[0] & 0xFFFF
    return struct.unpack("<f", struct.pack("<I", bits << 16))[0]


def ue8m0_down(x: float) -> float:
    return 2.0 ** (((struct.unpack("<I", struct.pack("<f", x))[0] >> 23) & 0xFF) - 127)


@pytest.mark.parametrize("read,decode,scale", [("ue8m0", ue8m0_down, 0.0131), ("bf16", bf16_low, 0.011)])
def test_an_fp32_scale_read_as_another_format_is_named(tmp_path, read, decode, scale):
    spec = dataclasses.replace(SPEC, k_scale=scale)  # not a power of two
    t, _, _ = pv.capture(spec)
    out, lse = pv.attention(t, dataclasses.replace(spec, k_scale=decode(spec.k_scale)))  # the kernel's scale
    t["out"], t["lse"] = out.to(torch.bfloat16), lse.float()
    r = replay(tmp_path, t, spec)
    e = r.backends["observed"].explanation
    assert e is not None and e.hypothesis == "kv_scale_format", r.diagnosis_text
    assert e.detail["read"] == read and e.detail["stored"] == "fp32"
    assert e.detail["value_read"] == pytest.approx(decode(scale), rel=1e-6)
    assert r.diagnosis == "kv_contract" and r.diagnosis_text.startswith("kv_scale_format")


@pytest.mark.parametrize("fp8,block,stride", [(False, 16, 8), (True, 64, 16)])
def test_pages_read_at_another_page_stride_are_named(tmp_path, fp8, block, stride):
    """The kernel finds page p's token s at row p * stride + s (a bf16 cache strided as fp8, a
    64-token block strided as 16). The capture's NaN rows (past each end, the null block) are first
    overwritten with finite stale rows by this file, as a reused pool holds them."""
    spec = dataclasses.replace(SPEC, fp8=fp8, block=block, seq_lens=(70, 33, 141) if block == 16 else (70, 33, 141, 200))
    t, _, _ = pv.capture(spec)
    kv = t["kv_buffer"]
    g = torch.Generator().manual_seed(3)
    nan = torch.isnan(kv.float()).any(-1).flatten()
    stale = (torch.randn(int(nan.sum()), *kv.shape[1:], generator=g) * (8 if fp8 else 1)).to(kv.dtype)
    bits = kv.view(torch.uint8) if fp8 else kv
    bits[nan] = stale.view(torch.uint8) if fp8 else stale
    table = t["block_table"].long()
    rows = {b: table[b][torch.arange(L) // block] * stride + torch.arange(L) % block for b, L in enumerate(spec.seq_lens)}
    out, lse = pv.attention(t, spec, rows=rows)
    t["out"], t["lse"] = out.to(torch.bfloat16), lse.float()
    r = replay(tmp_path, t, spec)
    e = r.backends["observed"].explanation
    assert e is not None and e.hypothesis == "kv_page_stride", r.diagnosis_text
    row = 576 * kv.dtype.itemsize
    assert e.detail == {"stride": stride * row, "page_stride": block * row, "cache": "kv"} and e.complete
    assert r.diagnosis == "kv_contract" and r.diagnosis_text.startswith("kv_page_stride")
