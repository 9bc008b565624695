"""The local-extend baseline: its two implementations, its semantics, and extend-mode replays."""

from __future__ import annotations

import json
import math

import pytest
import torch

from refmla import reference as ref
from refmla.attended import Attended
from refmla.backends.extend import as_extend, mla_extend_local, run_triton_extend, scatter_rows, triton_extend_status
from refmla.capture import read_capture
from refmla.cli import main as cli
from refmla.compare import compare
from refmla.context import ReplayContext, ReplayOptions
from refmla.pipeline import run_backend
from refmla.synthetic import SynthSpec, preset, synth_capture

TRITON_OK, TRITON_WHY = triton_extend_status()
needs_triton = pytest.mark.skipif(not TRITON_OK, reason=f"SGLang Triton extend unavailable: {TRITON_WHY}")

SMALL_DECODE = SynthSpec(name="small-decode", num_heads=8, seq_lens=(37, 1, 64, 5), page_size=16, seed=11)
SMALL_EXTEND = SynthSpec(name="small-extend", num_heads=8, seq_lens=(40, 9, 3), new_tokens=3, seed=12)
HOSTILE = preset("hostile")  # NaN pools, a zero-length request, page size 16


def load(tmp_path, spec: SynthSpec, fault: str = "none"):
    path = tmp_path / f"{spec.name}-{fault}.safetensors"
    synth_capture(path, spec, fault)
    return read_capture(path)


def dense_extend(cap) -> torch.Tensor:
    """Independent fp64 formulation: all positions at once, an explicit bottom-right causal mask."""
    q, Dv = cap.q.double(), cap.meta.kv_lora_rank
    qo = cap.qo_indptr.long() if not cap.is_decode else torch.arange(cap.batch_size + 1)
    out = torch.zeros(q.shape[0], q.shape[1], Dv, dtype=torch.float64)
    for b in range(cap.batch_size):
        rows = cap.kv_indices[int(cap.kv_indptr[b]) : int(cap.kv_indptr[b + 1])].long()
        t0, t1 = int(qo[b]), int(qo[b + 1])
        L, n = len(rows), t1 - t0
        if L == 0 or n == 0:
            continue
        K = cap.kv_buffer[rows, 0].double() * cap.meta.k_scale  # [L, D]
        s = torch.einsum("thd,ld->thl", q[t0:t1], K) * cap.meta.sm_scale  # [n, H, L]
        if cap.meta.logit_cap > 0:
            s = cap.meta.logit_cap * torch.tanh(s / cap.meta.logit_cap)
        allowed = torch.arange(L)[None, :] <= (L - n + torch.arange(n))[:, None]  # [n, L] bottom-right
        w = torch.softmax(s.masked_fill(~allowed[:, None, :], -math.inf), dim=-1)
        out[t0:t1] = w @ (cap.kv_buffer[rows, 0, :Dv].double() * cap.meta.v_scale)
    return out


def judge(cap, out) -> bool:
    ctx = ReplayContext(cap, ReplayOptions(backends=[]))
    return ctx.compare("x", out).passed


@pytest.mark.parametrize("spec", [SMALL_DECODE, SMALL_EXTEND, HOSTILE], ids=lambda s: s.name)
def test_reference_extend_matches_dense(tmp_path, spec):
    cap = load(tmp_path, spec)
    qo = cap.qo_indptr if not cap.is_decode else torch.arange(cap.batch_size + 1)
    out, _ = ref.mla_verify_ref(cap.q, cap.kv_buffer, Attended.token_index(cap.kv_indptr, cap.kv_indices, qo), cap.scales())
    torch.testing.assert_close(out, dense_extend(cap), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("spec", [SMALL_DECODE, SMALL_EXTEND, HOSTILE], ids=lambda s: s.name)
def test_torch_extend_passes_against_dense(tmp_path, spec):
    """The kernel-precision PyTorch extend is within the comparator's tolerance of the dense truth."""
    cap = load(tmp_path, spec)
    inp = as_extend(cap)
    out, _ = mla_extend_local(inp, cap.kv_buffer, cap.scales(), torch.bfloat16)
    full = scatter_rows(out, inp)
    ctl = ReplayContext(cap, ReplayOptions(backends=[])).control(torch.bfloat16)
    cmp = compare("torch_extend", full, dense_extend(cap), ctl, request_of_row=cap.request_of_row())
    assert cmp.passed, cmp.reasons
    assert torch.isfinite(full).all()  # NaN pool rows never attended


def test_one_token_extend_is_decode(tmp_path):
    cap = load(tmp_path, SMALL_DECODE)
    inp = as_extend(cap)
    lens = cap.seq_lens.long()
    assert inp.qo_indptr.tolist() == [0, 1, 2, 3, 4]
    assert (inp.prefix_indptr[1:] - inp.prefix_indptr[:-1]).tolist() == (lens - 1).tolist()
    last = cap.kv_indices.long()[cap.kv_indptr[1:].long() - 1]  # the current token's row
    assert torch.equal(inp.k_extend[:, 0], cap.kv_buffer[last, 0])
    # fp64 semantics: one new token per request is exactly decode
    one_each = Attended.token_index(cap.kv_indptr, cap.kv_indices, torch.arange(cap.batch_size + 1))
    dec, dlse = ref.mla_decode_ref(cap.q, cap.kv_buffer, cap.attended(), cap.scales())
    ext, else_ = ref.mla_verify_ref(cap.q, cap.kv_buffer, one_each, cap.scales())
    torch.testing.assert_close(ext, dec, rtol=0, atol=1e-13)
    torch.testing.assert_close(else_, dlse, rtol=0, atol=1e-13)
    # kernel precision: passes as a decode output
    out, _ = mla_extend_local(inp, cap.kv_buffer, cap.scales(), torch.bfloat16)
    assert judge(cap, scatter_rows(out, inp))


def test_zero_length_request_row_is_zero(tmp_path):
    cap = load(tmp_path, HOSTILE)
    entry = run_backend("extend", ReplayContext(cap, ReplayOptions(backends=["extend"]))).to_json()
    assert entry["status"] == "pass", entry.get("reason")
    inp = as_extend(cap)
    empty = int(torch.nonzero(cap.seq_lens == 0)[0])
    assert empty not in inp.out_rows.tolist()


def test_causal_view_matters(tmp_path):
    """The comparator tells the new tokens' views apart: the first token given the last one's fails."""
    cap = load(tmp_path, SMALL_EXTEND)
    inp = as_extend(cap)
    good, _ = mla_extend_local(inp, cap.kv_buffer, cap.scales(), torch.bfloat16)
    assert judge(cap, scatter_rows(good, inp))
    qo = inp.qo_indptr
    bad = good.clone()
    bad[qo[:-1]] = good[qo[1:] - 1]
    assert not judge(cap, scatter_rows(bad, inp))


@needs_triton
@pytest.mark.parametrize("spec", [SMALL_DECODE, SMALL_EXTEND], ids=lambda s: s.name)
def test_triton_extend_matches_reference(tmp_path, spec):
    cap = load(tmp_path, spec)
    inp = as_extend(cap)
    out, lse, info = run_triton_extend(inp, cap.kv_buffer, cap.scales(), torch.bfloat16)
    assert info["kernel"].endswith("extend_attention_fwd")
    assert judge(cap, scatter_rows(out, inp))
    if lse is not None:
        qo = cap.qo_indptr if not cap.is_decode else torch.arange(cap.batch_size + 1)
        _, rlse = ref.mla_verify_ref(cap.q, cap.kv_buffer, Attended.token_index(cap.kv_indptr, cap.kv_indices, qo), cap.scales())
        torch.testing.assert_close(scatter_rows(lse, inp, -math.inf).double(), rlse, rtol=0, atol=1e-4)


@needs_triton
def test_backend_reports_both_implementations(tmp_path):
    cap = load(tmp_path, SMALL_EXTEND)
    entry = run_backend("extend", ReplayContext(cap, ReplayOptions(backends=["extend"]))).to_json()
    assert entry["status"] == "pass", entry.get("reason")
    info = entry["info"]
    assert info["implementation"] == "sglang_triton"
    assert info["torch_extend"]["status"] == "pass"
    assert "extend_attention_fwd" in info["triton"]["kernel"]


def test_torch_only_backend_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv("REFMLA_EXTEND_IMPL", "torch")
    cap = load(tmp_path, SMALL_DECODE)
    entry = run_backend("extend", ReplayContext(cap, ReplayOptions(backends=["extend"]))).to_json()
    assert entry["status"] == "pass", entry.get("reason")
    assert entry["info"]["implementation"] == "torch"
    assert entry["info"]["sglang_triton_extend"]["status"] == "skipped"


@pytest.mark.parametrize("fault", ["none", "wrong_sm_scale"])
def test_extend_capture_replays(tmp_path, capsys, monkeypatch, fault):
    """An extend-mode capture through the CLI: the extend path agrees; a planted fault is the observed one."""
    monkeypatch.setenv("REFMLA_EXTEND_IMPL", "torch")  # the Triton extend has its own tests above
    path = tmp_path / f"ext-{fault}.safetensors"
    synth_capture(path, SMALL_EXTEND, fault)
    code = cli(["replay", str(path), "--backend", "extend", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert report["mode"] == "extend"
    assert report["backends"]["extend"]["status"] == "pass"
    if fault == "none":
        assert code == 0 and report["verdict"] == "agree" and report["diagnosis"] is None
    else:
        assert code == 1 and report["diagnosis"] == "observed"
        e = report["backends"]["observed"]["explanation"]
        assert e["hypothesis"] == "wrong_sm_scale"
        assert e["detail"]["ratio"] == pytest.approx((192**-0.5) / SMALL_EXTEND.sm_scale, rel=1e-9)
