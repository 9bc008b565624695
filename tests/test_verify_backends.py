"""Verify captures through every path that can compute them (issue 13): aiter's mla_decode_fwd with
max_seqlen_q > 1 (against the stand-in), SGLang's Triton extend kernel with the custom mask, and
the plain-decode path per query (Triton decode kernel, aiter with qlen 1)."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

from refmla.backends.per_query import per_query_batch
from refmla.capture import read_capture
from refmla.context import ReplayContext, ReplayOptions
from refmla.pipeline import backend_names, replay_file, run_backend
from refmla.synthetic import preset, synth_capture

SMALL = dict(seq_lens=(37, 16, 9), num_heads=8)



def _capture(tmp_path, name="kimi-k2-tp8-mtp", fault="none", **kw):
    spec = preset(name, **{**SMALL, **kw})
    path = tmp_path / f"{name}-{fault}.safetensors"
    synth_capture(path, spec, fault)
    return read_capture(path)


def _entry(cap, backend, **opts):
    o = ReplayOptions(backends=[backend])
    for k, v in opts.items():
        setattr(o, k, v)  # e.g. aiter_page_size, read by getattr
    return run_backend(backend, ReplayContext(cap, o)).to_json()


def _spy(monkeypatch, standin):
    """Record the keyword arguments of every mla_decode_fwd call, then run the stand-in."""
    seen, real = [], standin.mla_decode_fwd

    @functools.wraps(real)  # the adapter reads the signature
    def spy(**kw):
        seen.append(kw)
        return real(**kw)

    monkeypatch.setattr(standin, "mla_decode_fwd", spy)
    return seen


# --- aiter mla_decode_fwd with max_seqlen_q > 1 ------------------------------------------------


@pytest.mark.parametrize("convention", ["token", "page"])
@pytest.mark.parametrize("qlen", [1, 2, 3, 4, 5, 6, 7, 8])
def test_aiter_verify_contract(standin, monkeypatch, tmp_path, qlen, convention):
    P = 16 if convention == "page" else 1
    cap = _capture(tmp_path, draft_token_num=qlen, page_size=16)
    seen = _spy(monkeypatch, standin)
    entry = _entry(cap, "aiter", **({"aiter_page_size": P} if convention == "page" else {}))
    assert entry["status"] == "pass", entry.get("reason")
    kw = seen[-1]
    B = cap.batch_size
    assert kw["max_seqlen_q"] == qlen and type(kw["max_seqlen_q"]) is int
    assert kw["qo_indptr"].tolist() == [b * qlen for b in range(B + 1)]
    assert kw["q"].shape[0] == B * qlen and kw["o"].shape[0] == B * qlen
    lens = cap.seq_lens.long()  # prefix + drafts, as SGLang's kv_lens = seq_lens + draft_token_num
    if convention == "token":
        assert torch.equal(kw["kv_indptr"].cpu().long(), cap.kv_indptr.long())
    else:
        assert kw["kv_last_page_lens"].tolist() == ((lens - 1) % P + 1).tolist()
        assert int(kw["kv_indptr"][-1]) == int(((lens + P - 1) // P).sum())
    assert entry["info"]["max_seqlen_q"] == qlen and entry["info"]["index_convention"] == convention


def test_aiter_refuses_a_tree(standin, tmp_path):
    cap = _capture(tmp_path, "kimi-k2-tp8-eagle-tree", seq_lens=(37, 16, 9))
    entry = _entry(cap, "aiter")
    assert entry["status"] == "skipped" and "tree mask" in entry["reason"]
    assert standin.CALLS == []


def test_aiter_verify_bug_is_a_failure(standin, monkeypatch, tmp_path):
    """A kernel that treats each verify query as if it saw the whole sequence (no causal mask) fails."""
    cap = _capture(tmp_path, draft_token_num=3)
    real = standin.mla_decode_fwd

    @functools.wraps(real)
    def no_causal(**kw):
        o = real(**kw)
        B = kw["qo_indptr"].shape[0] - 1
        q = kw["q"]
        last = torch.arange(B) * kw["max_seqlen_q"] + kw["max_seqlen_q"] - 1  # the last query sees everything
        kw["o"][:] = kw["o"][last.repeat_interleave(kw["max_seqlen_q"])] if q.shape[0] else kw["o"]
        return o

    monkeypatch.setattr(standin, "mla_decode_fwd", no_causal)
    entry = _entry(cap, "aiter")
    assert entry["status"] == "fail"


# --- the plain-decode path per query -----------------------------------------------------------


def test_per_query_batch_is_prefix_plus_drafts_before(tmp_path):
    cap = _capture(tmp_path, draft_token_num=3)
    batch = per_query_batch(cap)
    n = 3
    want = [L - n + i + 1 for L in cap.seq_lens.tolist() for i in range(n)]
    assert batch.lens.tolist() == want
    first = cap.kv_indices[: want[0]]
    assert torch.equal(batch.kv_indices[: want[0]], first.long())


def test_per_query_batch_follows_the_tree(tmp_path):
    cap = _capture(tmp_path, "kimi-k2-tp8-eagle-tree", seq_lens=(37, 16, 9))
    batch = per_query_batch(cap)
    m, n = cap.mask_indptr.long(), 4
    rows = [cap.custom_mask[int(m[b]) : int(m[b + 1])].view(n, -1).sum(-1) for b in range(cap.batch_size)]
    assert batch.lens.tolist() == torch.cat(rows).tolist()
    assert batch.lens.tolist() != [L - n + i + 1 for L in cap.seq_lens.tolist() for i in range(n)]


@pytest.mark.parametrize("name", ["kimi-k2-tp8-mtp", "kimi-k2-tp8-eagle-tree"])
def test_aiter_per_query_decode(standin, tmp_path, name):
    cap = _capture(tmp_path, name)
    entry = _entry(cap, "aiter_decode_per_query")
    assert entry["status"] == "pass", entry.get("reason")
    assert all(c["B"] == cap.q.shape[0] for c in standin.CALLS)  # one decode request per query token


@pytest.mark.slow
@pytest.mark.parametrize("name", ["kimi-k2-tp8-mtp", "kimi-k2-tp8-eagle-tree"])
def test_triton_paths_agree_on_a_clean_verify(tmp_path, name):
    cap = _capture(tmp_path, name)
    for backend in ("triton_decode_per_query", "extend"):
        entry = _entry(cap, backend)
        assert entry["status"] == "pass", (backend, entry.get("reason"))
    ext = _entry(cap, "extend")["info"]
    assert ext["implementation"] == "sglang_triton" and ext["triton"]["custom_mask"]


def test_per_query_backends_run_on_verify_captures_only(tmp_path):
    spec = preset("kimi-k2-tp8", seq_lens=(20, 9), num_heads=4, num_kv_splits=None)
    path = tmp_path / "d.safetensors"
    synth_capture(path, spec)
    cap = read_capture(path)
    opts = ReplayOptions()
    assert "triton_decode_per_query" not in backend_names(opts, "decode")
    assert "triton_decode_per_query" in backend_names(opts, "verify")
    entry = _entry(cap, "triton_decode_per_query")
    assert entry["status"] == "skipped" and "verify captures only" in entry["reason"]


@pytest.mark.slow
def test_done_when_mtp_preset_replays_through_every_path(tmp_path):
    """`refmla synth x --preset kimi-k2-tp8-mtp` then `refmla replay x`: every path agrees, aiter
    skipped here with its reason."""
    path = tmp_path / "x.safetensors"
    synth_capture(path, preset("kimi-k2-tp8-mtp"))
    rep = replay_file(path, ReplayOptions()).to_json()
    b = rep["backends"]
    assert rep["verdict"] == "agree" and rep["mode"] == "verify"
    for name in ("reference", "observed", "extend", "triton_decode_per_query"):
        assert b[name]["status"] == "pass", (name, b[name].get("reason"))
    assert b["aiter"]["status"] == "skipped" and b["aiter"]["reason"]
    assert b["extend"]["info"]["custom_mask"].startswith("causal")


def test_aiter_pow2_padding_bug_is_named(standin, monkeypatch, tmp_path):
    """aiter issue #2720's class: a kernel that strides queries by the next power of two of qlen."""
    from refmla.synthetic.verify_faults import padded_queries

    cap = _capture(tmp_path, draft_token_num=3)
    real = standin.mla_decode_fwd

    @functools.wraps(real)
    def pow2(**kw):
        kw["q"] = padded_queries(kw["q"], kw["qo_indptr"], 4).contiguous()
        return real(**kw)

    monkeypatch.setattr(standin, "mla_decode_fwd", pow2)
    entry = _entry(cap, "aiter")
    assert entry["status"] == "fail"
    exp = entry["explanation"]
    assert exp["hypothesis"] == "qlen_pow2_padding"
    assert exp["detail"] == {"qlen": 3, "padded_to": 4, "reads": "queries"}


def test_triton_per_query_carries_its_split_control(tmp_path):
    """The per-query decode runs SGLang's split schedule, which the verify capture does not carry:
    it is judged against a control at those rounding points (fp32 partials, fp32 merge)."""
    from refmla.backends.per_query import TritonDecodePerQueryBackend
    from refmla.context import ReplayContext

    cap = _capture(tmp_path, draft_token_num=3, seq_lens=(300, 41, 9), num_heads=4)
    be = TritonDecodePerQueryBackend()
    ok, why = be.availability()
    if not ok:
        pytest.skip(why)
    res = be.run(cap, ReplayOptions(cu_count=256))
    assert res.control is not None and res.control.shape == res.out.shape
    assert "split-aware" in res.info["control"]
    ctx = ReplayContext(cap, ReplayOptions())
    assert not torch.equal(res.control, ctx.control(res.control.dtype)), "300 tokens split: other rounding points"
    assert ctx.compare("t", res.out, control=res.control).passed


@pytest.mark.parametrize("case", ["kimi-h8-verify-q2-page16", "kimi-h8-verify-q3", "dsv3-h16-verify-q4-tree"])
def test_verify_goldens_through_the_aiter_stand_in(standin, case):
    """The verify goldens (qlen 2, 3, 4) through the aiter adapter against the stand-in: the chains
    pass with max_seqlen_q = qlen, the tree is skipped (aiter has no tree mask); per-query aiter passes."""
    from refmla import golden

    path = Path(__file__).resolve().parents[1] / "golden" / f"{case}.safetensors"
    res = golden.check(path, "aiter")
    if "tree" in case:
        assert res.status == "skipped" and "tree mask" in res.reason
    else:
        assert res.status == "pass", res.message()
        assert res.entry.info["max_seqlen_q"] == int(case.split("-q")[1][0])
    per_query = golden.check(path, "aiter_decode_per_query")
    assert per_query.status == "pass", per_query.message()


def test_seed_question_plain_decode_diverges_verify_agrees(standin, monkeypatch, tmp_path):
    """The investigation's comparison as one replay: over the same KV, aiter's verify call agrees and
    its plain decode (max_seqlen_q = 1) does not -> diagnosis ``decode``, the table says which path."""
    cap = _capture(tmp_path, draft_token_num=3)
    real = standin.mla_decode_fwd

    @functools.wraps(real)
    def decode_bug(**kw):
        r = real(**kw)
        if kw["max_seqlen_q"] == 1:
            kw["o"].mul_(1.02)  # a decode-only kernel bug
        return r

    monkeypatch.setattr(standin, "mla_decode_fwd", decode_bug)
    from refmla.pipeline import replay_capture

    rep = replay_capture(cap, ReplayOptions(backends=["aiter", "aiter_decode_per_query"], explain=False)).to_json()
    assert rep["backends"]["aiter"]["status"] == "pass"
    assert rep["backends"]["aiter_decode_per_query"]["status"] == "fail"
    assert rep["diagnosis"] == "decode" and "verify path agrees (aiter)" in rep["diagnosis_text"]
    rows = {r["backend"]: (r["path"], r["status"]) for r in rep["verify_vs_decode"]}
    assert rows["aiter"] == ("verify", "pass") and rows["aiter_decode_per_query"] == ("plain decode", "fail")
