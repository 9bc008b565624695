"""Attention sinks as FlashMLA defines them (its docstring and tests/ref.py: the output scaled by
1 / (1 + exp(sink - lse))): a sink of +inf gives an output of 0, a sink of -inf changes nothing, and
both replay as agreeing on clean data; NaN in a sink is a finding (upstream_nonfinite). The stored
output is written by this file's own FlashMLA-style formulation on the quantizer's values, and the
FlashMLA kernel path is the stand-in written from FlashMLA's interface (tests/standins), never the
reference the replay measures with."""

from __future__ import annotations

import dataclasses
import math
import sys
from pathlib import Path

import pytest
import torch

from refmla.options import ReplayOptions
from refmla.pipeline import replay_file
from refmla.sparse.format import SparseCapture, parse_sparse_meta
from refmla.sparse.presets import sparse_preset
from refmla.sparse.reference import sparse_control, sparse_reference
from refmla.sparse.synth import build_case
from refmla.sparse.validation import write_sparse

V4 = "deepseek-v4-flash-tp8"  # FlashMLA's V4 "MODEL1" bytes, a per-head sink, an extra (compressed) cache
STANDINS = Path(__file__).resolve().parent / "standins"
INF = math.inf


def with_sinks(*values: float):
    """The V4 case with its first heads' sinks set to ``values`` (the rest as the preset drew them)."""
    case = build_case(sparse_preset(V4))
    sink = case.sink.clone()
    sink[: len(values)] = torch.tensor(values, dtype=sink.dtype)
    return dataclasses.replace(case, sink=sink)


def flashmla_written(case) -> tuple[torch.Tensor, torch.Tensor]:
    """out [B, 1, H, Dv] bf16 and lse [B, 1, H] fp32 the way FlashMLA's reference writes them: both
    scopes' keys with a mask, logsumexp, out *= 1 / (1 + exp(sink - lse)), lonely rows 0 / +inf."""
    p, keys, bad = case.preset, [], []
    for pool, idx, ln in ((case.main, case.indices, case.topk_length), (case.extra, case.extra_indices, case.extra_topk_length)):
        if pool is None:
            continue
        i = idx[:, 0].long()  # [B, K]
        bad.append((i == -1) | (torch.arange(i.shape[1])[None] >= ln.long()[:, None]))
        keys.append(pool.values[i.clamp(min=0)].nan_to_num(0.0))  # [B, K, D]
    k, masked = torch.cat(keys, 1), torch.cat(bad, 1)
    w = torch.einsum("bhd,bkd->bhk", case.q[:, 0].double(), k) * p.softmax_scale
    w = w.masked_fill(masked[:, None], -INF)
    lse = w.logsumexp(-1)  # [B, H]
    out = torch.exp(w - lse[..., None]) @ k[..., : p.head_dim_v]  # [B, H, Dv]
    out = out * (1.0 / (1.0 + torch.exp(case.sink.double()[None] - lse)))[..., None]
    lonely = lse == -INF
    out[lonely] = 0.0
    return out[:, None].to(torch.bfloat16), torch.where(lonely, INF, lse)[:, None].float()


def write(path: Path, case) -> Path:
    out, lse = flashmla_written(case)
    write_sparse(path, {**case.tensors(), "out": out, "lse": lse}, case.meta())
    return path


def capture(case) -> SparseCapture:
    return SparseCapture(path="mem", meta=parse_sparse_meta(case.meta()), **case.tensors())


@pytest.mark.parametrize("sinks", [(INF,), (-INF,), (INF, -INF)], ids=["plus_inf", "minus_inf", "both"])
def test_a_clean_capture_with_infinite_sinks_agrees(tmp_path, sinks):
    case = with_sinks(*sinks)
    r = replay_file(str(write(tmp_path / "s.safetensors", case)), ReplayOptions(backends=["reference", "observed"]))
    assert r.verdict == "agree" and r.diagnosis is None, (r.verdict, r.diagnosis, r.diagnosis_text)
    obs = r.backends["observed"]
    assert obs.status == "pass" and obs.lse is not None and obs.lse.status == "pass"


def test_plus_inf_is_an_output_of_zero_and_minus_inf_is_no_sink():
    """The reference and the control: head 0 (+inf) is 0 wherever the row attends; head 1 (-inf) is
    the sink-less value; the lse leaves the sink out either way."""
    case = with_sinks(INF, -INF)
    none = dataclasses.replace(case, sink=None)
    for run in (sparse_reference, sparse_control):
        got, want = run(capture(case)), run(capture(none))
        assert torch.equal(got.out[:, :, 0], torch.zeros_like(got.out[:, :, 0]))
        assert bool(want.out[:, :, 0].abs().amax() > 0)  # the zero comes from the sink, not the data
        assert torch.equal(got.out[:, :, 1], want.out[:, :, 1])
        assert torch.equal(got.lse, want.lse)


def test_nan_in_a_sink_beside_infinite_ones_is_upstream_nonfinite(tmp_path):
    case = with_sinks(INF, -INF, math.nan)
    r = replay_file(str(write(tmp_path / "n.safetensors", case)), ReplayOptions(backends=["reference", "observed"]))
    assert r.verdict == "diverged" and r.diagnosis == "upstream_nonfinite", (r.diagnosis, r.diagnosis_text)
    assert "attn_sink" in r.diagnosis_text and r.exit_code == 1


def test_flashmla_kernel_path_with_infinite_sinks_passes(tmp_path, monkeypatch):
    """FlashMLA's sparse decode (its stand-in: its own byte decode and loop) on the +-inf capture."""
    path = write(tmp_path / "k.safetensors", with_sinks(INF, -INF))
    monkeypatch.delitem(sys.modules, "flash_mla", raising=False)
    monkeypatch.syspath_prepend(str(STANDINS / "flashmla_sparse"))
    import flash_mla

    monkeypatch.setitem(sys.modules, "flash_mla", flash_mla)
    r = replay_file(str(path), ReplayOptions(backends=["reference", "observed", "flashmla_sparse"]))
    e = r.backends["flashmla_sparse"]
    assert r.verdict == "agree" and e.status == "pass" and e.lse is not None and e.lse.status == "pass", (e.status, e.reason)
