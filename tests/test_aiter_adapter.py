"""The aiter adapter against a stand-in (tests/standins/): what it passes and what it reads back.

The real aiter needs a ROCm GPU. The stand-in checks every argument against aiter's conventions
(and raises on the first wrong one), then computes the documented semantics with the reference,
so the adapter passes here exactly when it calls aiter the way SGLang's aiter backend does.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from helpers import STANDINS, forget_aiter

from refmla.backends import get_backend
from refmla.backends.aiter import AiterBackend, aiter_status
from refmla.capture import read_capture, write_capture
from refmla.context import ReplayContext, ReplayOptions
from refmla.pipeline import run_backend
from refmla.synthetic import SynthSpec, make_inputs, make_meta, synth_capture




@dataclasses.dataclass
class Case:
    heads: int  # query heads on this rank: 8 (Kimi-K2 TP8), 16 (DeepSeek-V3 TP8), 128 (TP1)
    convention: str  # "token": page size 1, SGLang slots; "page": aiter pages of page_size
    page_size: int = 16
    seq_lens: tuple = (37, 16, 5, 64, 1)  # a partial last page, a full one, a single token
    seed: int = 3


def capture_for(tmp_path, case: Case, compact: bool = False):
    P = case.page_size if case.convention == "page" else 1
    spec = SynthSpec(name="aiter-contract", num_heads=case.heads, seq_lens=case.seq_lens, page_size=P, seed=case.seed)
    path = tmp_path / f"h{case.heads}-{case.convention}.safetensors"
    if compact:
        t = make_inputs(spec)
        t["out"] = torch.zeros(len(case.seq_lens), case.heads, spec.kv_lora_rank, dtype=spec.dtype)
        write_capture(path, t, make_meta(spec), compact=True)
    else:
        synth_capture(path, spec, "none")
    return read_capture(path)


def replay_aiter(cap) -> dict:
    return run_backend("aiter", ReplayContext(cap, ReplayOptions(backends=["aiter"]))).to_json()


@pytest.mark.parametrize("convention", ["token", "page"])
@pytest.mark.parametrize("heads", [8, 16, 128])
def test_contract(standin, tmp_path, heads, convention):
    cap = capture_for(tmp_path, Case(heads, convention))
    entry = replay_aiter(cap)
    assert entry["status"] == "pass", entry.get("reason")
    call = standin.CALLS[-1]
    assert call["signature"] == "v0.1.11"
    assert call["heads"] == max(heads, 16)  # padded to aiter's 16
    info = entry["info"]
    assert info["stand_in"] is True and info["index_convention"] == convention
    if convention == "token":
        assert call["kv_buffer_shape"] == [cap.kv_buffer.shape[0], 1, 1, 576]
        assert torch.equal(call["kv_last_page_lens"].cpu(), torch.ones(cap.batch_size, dtype=torch.int32))
    else:
        P = cap.meta.page_size
        assert call["kv_buffer_shape"][1:] == [P, 1, 576]
        lens = cap.seq_lens.long()
        assert call["kv_last_page_lens"].tolist() == ((lens - 1) % P + 1).tolist()
        assert len(call["kv_indices"]) == int(((lens + P - 1) // P).sum())  # one entry per page
    if heads < 16:  # repeat_interleave: kernel head 2h and 2h+1 are query head h
        f = 16 // heads
        q_in = call["q"].cpu()
        for r in range(f):
            assert torch.equal(q_in[:, r::f], cap.q)


@pytest.mark.parametrize("convention", ["token", "page"])
def test_pre_v0_1_11_signature(standin, tmp_path, monkeypatch, convention):
    """Before v0.1.11 there is no page_size / nhead_kv before sm_scale: keywords keep the call right."""
    monkeypatch.setattr(standin, "mla_decode_fwd", standin.mla_decode_fwd_v0_1_10)
    cap = capture_for(tmp_path, Case(8, convention))
    entry = replay_aiter(cap)
    assert entry["status"] == "pass", entry.get("reason")
    assert standin.CALLS[-1]["signature"] == "v0.1.10"
    assert "page_size" not in entry["info"]["kernel_params"]
    if convention == "page":
        assert any("kv_buffer.shape[1]" in n for n in entry["info"]["notes"])


def test_positional_order_differs_between_releases(standin, tmp_path):
    """Why the adapter calls by keyword: the old positional order puts sm_scale into page_size."""
    cap = capture_for(tmp_path, Case(16, "token"))
    from refmla.backends.aiter import aiter_decode_args

    args, _ = aiter_decode_args(cap.q, cap.kv_buffer, cap.kv_indptr, cap.kv_indices)
    o = torch.empty(cap.batch_size, 16, 512, dtype=torch.bfloat16)
    with pytest.raises(standin.ContractViolation, match="page_size"):
        standin.mla_decode_fwd(cap.q, args["kv_buffer"], o, args["qo_indptr"], args["kv_indptr"], args["kv_indices"],
                               args["kv_last_page_lens"], 1, cap.meta.sm_scale)  # fmt: skip


def test_head_padding_slice_bug_is_caught_and_explained(standin, tmp_path, monkeypatch):
    """repeat_interleave to 16 then o[:, :H]: the comparator fails it and names head_misaligned."""
    import refmla.backends.aiter.heads as adapter

    def buggy(q):
        f = 16 // q.shape[1]
        return q.repeat_interleave(f, dim=1), (lambda o: o[:, : q.shape[1]]), "buggy"

    monkeypatch.setattr(adapter, "pad_heads", buggy)
    cap = capture_for(tmp_path, Case(8, "token"))
    entry = replay_aiter(cap)
    assert entry["status"] == "fail"
    e = entry["explanation"]
    assert e["hypothesis"] == "head_misaligned"
    assert e["detail"]["heads"] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert "[:8] instead of [::2]" in e["detail"]["mapping"]


def test_buggy_decode_kernel_is_diagnosed_decode(standin, tmp_path, monkeypatch):
    """aiter wrong, extend right, production output right: the decode compute path is named."""
    import refmla.backends.aiter.heads as adapter
    from refmla.pipeline import replay_capture

    monkeypatch.setenv("REFMLA_EXTEND_IMPL", "torch")
    monkeypatch.setattr(adapter, "pad_heads", lambda q: (q.repeat_interleave(2, dim=1), lambda o: o[:, :8], "buggy"))
    report = replay_capture(capture_for(tmp_path, Case(8, "token")), ReplayOptions(backends=["aiter", "extend"])).to_json()
    assert report["verdict"] == "diverged"
    assert report["diagnosis"] == "decode" and report["diagnosis_backends"] == ["aiter"]
    assert report["backends"]["extend"]["status"] == "pass"
    assert report["backends"]["aiter"]["explanation"]["hypothesis"] == "head_misaligned"


def test_compacted_pool_falls_back_to_page_size_1(standin, tmp_path):
    """A compacted capture renumbers rows, so pages no longer line up: token-level, still right."""
    cap = capture_for(tmp_path, Case(8, "page"), compact=True)
    entry = replay_aiter(cap)
    assert entry["info"]["index_convention"].startswith("token (page_size 16 not usable")
    assert entry["info"]["page_size"] == 1
    assert standin.CALLS[-1]["kv_buffer_shape"][1] == 1
    ctx = ReplayContext(cap, ReplayOptions(backends=["aiter"]))
    out = AiterBackend().run(cap, ReplayOptions()).out
    assert ctx.compare("aiter", out).passed


def test_logit_cap_is_refused_not_crashed(standin, tmp_path):
    spec = SynthSpec(name="capped", num_heads=8, seq_lens=(20, 7), logit_cap=30.0)
    synth_capture(tmp_path / "c.safetensors", spec, "none")
    entry = replay_aiter(read_capture(tmp_path / "c.safetensors"))
    assert entry["status"] == "skipped" and "logit_cap" in entry["reason"]


def test_extend_backend_reports_aiter_prefill(standin, tmp_path, monkeypatch):
    monkeypatch.setenv("REFMLA_EXTEND_IMPL", "torch")
    cap = capture_for(tmp_path, Case(8, "token"))
    entry = run_backend("extend", ReplayContext(cap, ReplayOptions(backends=["extend"]))).to_json()
    assert entry["status"] == "pass", entry.get("reason")
    pre = entry["info"]["aiter_prefill"]
    assert pre["status"] == "pass" and pre["stand_in"] is True, pre
    assert standin.CALLS[-1]["fn"] == "mla_prefill_fwd" and standin.CALLS[-1]["heads"] == 16


def test_unavailable_without_aiter(tmp_path):
    forget_aiter()
    ok, why = aiter_status()
    if ok:
        pytest.skip(f"an aiter is importable here: {why}")
    assert not get_backend("aiter").availability()[0]
    spec = SynthSpec(name="plain", num_heads=8, seq_lens=(9,))
    synth_capture(tmp_path / "p.safetensors", spec, "none")
    entry = replay_aiter(read_capture(tmp_path / "p.safetensors"))
    assert entry["status"] == "skipped" and entry["reason"] == why


def test_unrelated_pypi_aiter_is_not_taken(monkeypatch):
    forget_aiter()
    monkeypatch.syspath_prepend(str(STANDINS / "not_rocm_aiter"))
    try:
        ok, why = aiter_status()
    finally:
        forget_aiter()
    assert not ok and "not ROCm aiter" in why


SWEEP_SPACE = ["heads=16", "batch=3", "length=page+1", "page=16", "kv=bfloat16", "cap=0", "splits=1,2"]


def test_sweep_nan_fills_the_output_aiter_is_handed(standin, tmp_path, monkeypatch):
    """refmla sweep's nan_fill applies to aiter (the adapter allocates ``o``): the stand-in, which
    writes every row, passes; the same kernel made to leave request 2's row as the buffer held it
    (aiter #3069's class, planted by wrapping the stand-in here) is found under nan_fill."""
    import functools

    from refmla.sweep import SweepConfig, run_sweep

    cfg = dict(backends=["aiter"], budget=600, max_cases=2, layouts=["decode"], space=SWEEP_SPACE, max_shrink=0)
    rep = run_sweep(SweepConfig(out=str(tmp_path / "ok"), **cfg))
    assert rep.exit_code == 0 and rep.backends["aiter"].counts["nan_fill"] == {"pass": 2}, rep.backends["aiter"].counts
    real = standin.mla_decode_fwd

    @functools.wraps(real)
    def skips_request_2(*args, **kwargs):
        kept = kwargs["o"][2].clone()
        real(*args, **kwargs)
        kwargs["o"][2].copy_(kept)

    monkeypatch.setattr(standin, "mla_decode_fwd", skips_request_2)
    rep = run_sweep(SweepConfig(out=str(tmp_path / "planted"), **cfg))
    (f,) = [f for f in rep.findings if f.check == "nan_fill"]
    assert f.failing_cases == 2 and "row 2" in f.detail and f.replay_verdict == "diverged", f
