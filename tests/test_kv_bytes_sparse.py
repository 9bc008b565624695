"""DeepSeek-V4's sparse decode reading its pages' bytes another way: e4m3fn pages read as e4m3fnuz
(MI300X's encoding), and pages read at another stride (refmla.sparse.hypotheses).

The "kernel" here is this file's own: a byte-level decoder of V4's pages (bit arithmetic, no torch
fp8 view, no refmla decoder) and a plain softmax with the sink; the pages are refmla's synthetic
V4 case (the inputs only: what is planted is how this file reads them)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from refmla.options import ReplayOptions
from refmla.pipeline import replay_file
from refmla.sparse.presets import sparse_preset
from refmla.sparse.synth import build_case
from refmla.sparse.validation import write_sparse

SWA = "deepseek-v4-flash-tp8-swa"


def e4m3(byte: torch.Tensor, bias: int, fnuz: bool) -> torch.Tensor:
    """fp8 e4m3 by its bits: OCP e4m3fn (bias 7, S.1111.111 NaN) or e4m3fnuz (bias 8, 0x80 the only NaN)."""
    b = byte.long()
    s, e, m = b >> 7, (b >> 3) & 0xF, (b & 0x7).double()
    v = torch.where(e == 0, m / 8 * 2.0 ** (1 - bias), (1 + m / 8) * torch.pow(2.0, (e - bias).double()))
    v = torch.where(s == 1, -v, v)
    nan = (b == 0x80) if fnuz else ((e == 0xF) & (b & 0x7 == 0x7))
    return torch.where(nan, math.nan, v)


def v4_token(pages: torch.Tensor, page_size: int, stride: int, t: int, fnuz: bool) -> torch.Tensor:
    """Token t of a V4 cache read from the bytes at page stride ``stride``: [512] fp64."""
    flat = pages.reshape(-1)
    base = (t // page_size) * stride
    slot = t % page_size
    data = flat[base + slot * 576 : base + slot * 576 + 576]
    sc = flat[base + page_size * 576 + slot * 8 :][:7].long()
    nope = e4m3(data[:448], 8 if fnuz else 7, fnuz) * torch.pow(2.0, (sc - 127).double()).repeat_interleave(64)
    rope = torch.stack([data[448:576:2], data[449:576:2]], -1).contiguous().view(torch.int16)
    rope = (rope.long().reshape(-1) << 16).to(torch.int32).view(torch.float32).double()
    return torch.cat([nope, rope])


def kernel(case, fnuz: bool, stride: int) -> tuple[torch.Tensor, torch.Tensor]:
    """out [B, 1, H, Dv], lse [B, 1, H]: each request's valid entries, softmax with the sink."""
    p, pool = case.preset, case.main
    B, _, H, _ = case.q.shape
    out = torch.zeros(B, 1, H, p.head_dim_v, dtype=torch.float64)
    lse = torch.full((B, 1, H), math.inf, dtype=torch.float64)
    for b in range(B):
        idx = [int(i) for i in case.indices[b, 0, : int(case.topk_length[b])] if int(i) >= 0]
        if not idx:
            continue
        k = torch.stack([v4_token(pool.pages, pool.page_size, stride, i, fnuz) for i in idx])  # [n, 512]
        w = case.q[b, 0].double() @ k.T * p.softmax_scale  # [H, n]
        l = torch.logsumexp(w, -1)  # [H]
        o = torch.exp(w - l[:, None]) @ k[:, : p.head_dim_v]
        if case.sink is not None:
            o = o / (1 + torch.exp(case.sink.double() - l))[:, None]
        out[b, 0], lse[b, 0] = o, l
    return out, lse


def run(tmp_path, case, out, lse):
    path = tmp_path / "s.safetensors"
    write_sparse(path, {**case.tensors(), "out": out.to(torch.bfloat16), "lse": lse.float()}, case.meta())
    return replay_file(str(path), ReplayOptions(backends=["reference", "observed"]))


@pytest.fixture(scope="module")
def case():
    return build_case(dataclasses.replace(sparse_preset(SWA), seq_lens=(40, 130), page_size=64))


def test_the_kernel_reading_as_written_agrees(tmp_path, case):
    r = run(tmp_path, case, *kernel(case, fnuz=False, stride=int(case.main.pages.shape[1])))
    assert r.verdict == "agree", r.diagnosis_text


def test_v4_pages_written_e4m3fn_read_e4m3fnuz_are_named_with_both(tmp_path, case):
    r = run(tmp_path, case, *kernel(case, fnuz=True, stride=int(case.main.pages.shape[1])))
    e = r.backends["observed"].explanation
    assert e is not None and e.hypothesis == "kv_fp8_encoding_mismatch", r.diagnosis_text
    assert e.detail == {"written": "float8_e4m3fn", "read": "float8_e4m3fnuz"}
    assert r.diagnosis == "kv_contract" and r.diagnosis_text.startswith("kv_fp8_encoding_mismatch")


def test_pages_read_at_the_unpadded_stride_are_named(tmp_path, case):
    W = int(case.main.pages.shape[1])
    tight = case.main.page_size * 584
    assert tight != W  # V4 pads a page to a multiple of 576
    r = run(tmp_path, case, *kernel(case, fnuz=False, stride=tight))
    e = r.backends["observed"].explanation
    assert e is not None and e.hypothesis == "kv_page_stride", r.diagnosis_text
    assert e.detail == {"stride": tight, "page_stride": W, "cache": "main"}
