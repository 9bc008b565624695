"""A sparse kernel that only rounds differently is named as the dense search names it (issue 28 item 3,
the numerics variants): ``numerics(<variant>)`` with the dense detail and keys, diagnosis ``numerics``.

Production's output is this file's own plain loop over each query row and head (keys from the
synthetic pools' known values, never refmla's reference, control or search), with one rounding
point moved: P.V accumulated in bf16 a tile of 32 entries at a time, q.k accumulated in bf16 64
dims at a time, or the output stored toward zero (fp32 bits truncated). The same loop with the
standard rounding is a correct kernel: every sparse preset then agrees, with nothing to explain."""

from __future__ import annotations

import json
from typing import Optional

import pytest
import torch

from refmla.cli import main
from refmla.hypotheses.numerics import BY_NAME
from refmla.options import ReplayOptions
from refmla.pipeline import replay_file
from refmla.sparse.presets import PRESETS, sparse_preset
from refmla.sparse.synth import build_case
from refmla.sparse.validation import write_sparse

V4, V32 = "deepseek-v4-flash-tp8", "deepseek-v3.2-tp8"
# the variants that apply to sparse decode (bf16 output, P rounded to bf16, no split schedule)
SPARSE_VARIANTS = {"out_round_toward_zero", "out_round_half_away", "out_through_fp16", "p_fp32", "p_fp16",
                   "pv_accum_bf16", "pv_accum_fp16", "qk_accum_bf16", "qk_accum_fp16"}  # fmt: skip
TRIAL_KEYS = {"variant", "residual_ratio", "rows_closer", "confirmed"}  # the dense variants_tried entries


def kernel(case, pv: Optional[torch.dtype] = None, qk: Optional[torch.dtype] = None, truncate: bool = False):
    """(out [B, 1, H, Dv] bf16, lse [B, 1, H] fp32): q and the keys in fp32 (bf16 values), q.k in fp32
    (``qk``: summed in that dtype 64 dims at a time), p = exp(s - max) rounded to bf16, P.V in fp32 tiles
    of 32 entries (``pv``: the accumulator kept in that dtype), the sink in the denominator, the output
    stored to nearest (``truncate``: toward zero)."""
    p = case.preset
    B, _, H, D = case.q.shape
    Dv = p.head_dim_v
    out = torch.zeros(B, 1, H, Dv, dtype=torch.bfloat16)
    lse = torch.full((B, 1, H), float("inf"), dtype=torch.float32)
    caches = [(case.main, case.indices, case.topk_length)]
    if case.extra is not None:
        caches.append((case.extra, case.extra_indices, case.extra_topk_length))
    for b in range(B):
        keys = []
        for pool, idx, lengths in caches:
            tokens = [t for t in idx[b, 0, : int(lengths[b])].tolist() if t != -1]
            keys += [pool.values[t].float() for t in tokens]
        if not keys:
            continue  # lonely: out 0, lse +inf
        k = torch.stack(keys)  # [n, D]
        for h in range(H):
            q = case.q[b, 0, h].float()
            if qk is None:
                s = k @ q
            else:
                s = torch.zeros(len(k), dtype=qk)
                for c in range(0, D, 64):
                    s = (s.float() + k[:, c : c + 64] @ q[c : c + 64]).to(qk)
            s = s.float() * p.softmax_scale
            m = s.max()
            w = torch.exp(s - m)
            pb = w.to(torch.bfloat16).float()
            acc = torch.zeros(Dv, dtype=pv or torch.float32)
            for a in range(0, len(k), 32):
                acc = (acc.float() + pb[a : a + 32] @ k[a : a + 32, :Dv]).to(pv or torch.float32)
            denom = w.sum() + (torch.exp(case.sink[h] - m) if case.sink is not None else 0.0)
            r = acc.float() / denom
            out[b, 0, h] = (r.view(torch.int32) >> 16).to(torch.int16).view(torch.bfloat16) if truncate else r.to(torch.bfloat16)
            lse[b, 0, h] = m + torch.log(w.sum())
    return out, lse


def capture(tmp_path, preset: str, **rounding) -> str:
    case = build_case(sparse_preset(preset))
    out, lse = kernel(case, **rounding)
    path = tmp_path / f"{preset}.safetensors"
    write_sparse(path, {**case.tensors(), "out": out, "lse": lse}, case.meta())
    return str(path)


def _named(report, variant: str) -> dict:
    obs = report.backends["observed"]
    assert report.verdict == "diverged" and obs.status == "fail", obs.reason
    e = obs.explanation
    assert e is not None and (e.hypothesis, e.detail) == ("numerics", {"variant": variant}), e and e.text()
    assert report.diagnosis == "numerics" and report.diagnosis_backends == ["observed"], report.diagnosis_text
    assert f"different rounding ({variant})" in report.diagnosis_text
    return obs.to_json()["explanation"]


@pytest.mark.parametrize("preset", [V4, V32])
def test_pv_accumulated_in_bf16_is_named_with_the_dense_detail(tmp_path, preset):
    r = replay_file(capture(tmp_path, preset, pv=torch.bfloat16), ReplayOptions(backends=["reference", "observed"]))
    e = _named(r, "pv_accum_bf16")
    assert e["scope"] == "all requests" and e["why"] == BY_NAME["pv_accum_bf16"].description
    tried = {t["variant"]: t for t in e["variants_tried"]}
    assert set(tried) == SPARSE_VARIANTS and all(set(t) == TRIAL_KEYS for t in tried.values())
    assert tried["pv_accum_bf16"]["confirmed"] and not tried["p_fp32"]["confirmed"]
    assert 0 < e["residual_ratio"] <= 1 and e["heads"]


def test_qk_accumulated_in_bf16_is_named(tmp_path):
    r = replay_file(capture(tmp_path, V4, qk=torch.bfloat16), ReplayOptions(backends=["reference", "observed"]))
    _named(r, "qk_accum_bf16")


def test_an_output_stored_toward_zero_is_named_before_any_mistake_in_the_json(tmp_path, capsys):
    path = capture(tmp_path, V4, truncate=True)
    assert main(["replay", path, "--json", "--backend", "reference", "--backend", "observed"]) == 1
    d = json.loads(capsys.readouterr().out)
    e = d["backends"]["observed"]["explanation"]
    assert e["hypothesis"] == "numerics" and e["detail"] == {"variant": "out_round_toward_zero"}
    assert [t["variant"] for t in e["variants_tried"]][:1] == ["out_round_toward_zero"]  # the stores first
    assert d["diagnosis"] == "numerics"


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_a_correct_kernel_agrees_on_every_preset_with_nothing_to_explain(tmp_path, preset):
    r = replay_file(capture(tmp_path, preset), ReplayOptions(backends=["reference", "observed"]))
    obs = r.backends["observed"]
    assert r.verdict == "agree" and r.diagnosis is None and obs.status == "pass", obs.reason
    assert obs.explanation is None and "numerics_tried" not in obs.info


def test_noise_on_one_row_is_not_numerics_and_the_variants_ruled_out_are_listed(tmp_path, capsys):
    """A data fault on one request (request 2's rows off by 0.05 * noise): no variant fits it,
    the report lists the sparse variants tried, none confirmed (the dense info.numerics_tried)."""
    case = build_case(sparse_preset(V4))
    out, lse = kernel(case)
    g = torch.Generator().manual_seed(0)
    out[2, 0, 3] += (0.05 * torch.randn(out.shape[-1], generator=g)).to(out.dtype)
    path = tmp_path / "noise.safetensors"
    write_sparse(path, {**case.tensors(), "out": out, "lse": lse}, case.meta())
    assert main(["replay", str(path), "--json", "--backend", "reference", "--backend", "observed"]) == 1
    obs = json.loads(capsys.readouterr().out)["backends"]["observed"]
    assert obs["status"] == "fail" and "explanation" not in obs
    tried = obs["info"]["numerics_tried"]
    assert {t["variant"] for t in tried} == SPARSE_VARIANTS
    assert not any(t["confirmed"] for t in tried) and all(t["residual_ratio"] > 0 for t in tried)
