"""DeepSeek's sparse MLA decode (refmla.sparse): the fp64 reference against a dense formulation and
an independent implementation written here, the conventions (sink, lonely rows, lse, inverse rope),
validation, replay through SGLang's Triton sparse kernel, and every planted fault named."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from refmla.cli import main
from refmla.attended import Attended
from refmla.reference import mla_decode_ref
from refmla.scales import Scales
from refmla.sparse.faults import APPLIES, EXPECT, FAULTS, neighbour_entry
from refmla.sparse.format import SparseCapture, parse_sparse_meta
from refmla.sparse.validation import read_sparse
from refmla.sparse.make import synth_sparse
from refmla.sparse.presets import sparse_preset
from refmla.sparse.reference import inverse_rope, sparse_control, sparse_reference
from refmla.options import ReplayOptions
from refmla.pipeline import replay_file
from refmla.sparse.synth import build_case
from refmla.sparse.validation import problems

V4, V32 = "deepseek-v4-flash-tp8", "deepseek-v3.2-tp8"


def capture(case, **override) -> SparseCapture:
    t = {**case.tensors(), **override}
    return SparseCapture(path="mem", meta=parse_sparse_meta(case.meta()), **{k: v for k, v in t.items() if v is not None})


def small(name: str, **kw):
    return build_case(dataclasses.replace(sparse_preset(name), **kw))


def flashmla_style(case) -> tuple[torch.Tensor, torch.Tensor]:
    """The same semantics written another way (FlashMLA's tests/ref.py formulation): both scopes'
    keys concatenated with a mask, logsumexp, out *= 1 / (1 + exp(sink - lse)); keys from the values
    the quantizer produced (not decoded from the bytes)."""
    p = case.preset
    scopes = [(case.main, case.indices, case.topk_length)]
    if case.extra is not None:
        scopes.append((case.extra, case.extra_indices, case.extra_topk_length))
    keys, masks = [], []
    for pool, idx, ln in scopes:
        i = idx[:, 0].long()  # [B, K]
        bad = (i == -1) | (torch.arange(i.shape[1])[None] >= ln.long()[:, None])
        keys.append(pool.values[i.clamp(min=0)].nan_to_num(0.0))  # [B, K, D]
        masks.append(bad)
    k, bad = torch.cat(keys, 1), torch.cat(masks, 1)
    w = torch.einsum("bhd,bkd->bhk", case.q[:, 0].double(), k) * p.softmax_scale
    w = w.masked_fill(bad[:, None], -math.inf)
    lse = w.logsumexp(-1)  # [B, H]
    out = torch.exp(w - lse[..., None]) @ k[..., : p.head_dim_v]
    if case.sink is not None:
        out = out / (1 + torch.exp(case.sink.double()[None] - lse))[..., None]
    lonely = lse == -math.inf
    out[lonely] = 0.0
    return out, torch.where(lonely, math.inf, lse)


@pytest.mark.parametrize("name", [V4, V32, "deepseek-v4-flash-tp8-c128", "deepseek-v4-flash-tp8-swa"])
def test_reference_matches_an_independent_implementation(name):
    case = build_case(sparse_preset(name))
    ref = sparse_reference(capture(case))
    out, lse = flashmla_style(case)
    torch.testing.assert_close(ref.out[:, 0], out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ref.lse[:, 0], lse, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", [V32, "deepseek-v4-flash-tp8-swa"])
def test_reference_without_a_sink_is_dense_decode_over_the_attended_rows(name):
    case = small(name, sink=False)
    cap = capture(case)
    ref = sparse_reference(cap)
    rows = [[t for t in r[: int(n)].tolist() if t != -1] for r, n in zip(case.indices[:, 0], case.topk_length)]
    indptr = torch.tensor([0] + [sum(len(r) for r in rows[: b + 1]) for b in range(len(rows))])
    kv = case.main.values[:, None, :]  # [N, 1, D]
    att = Attended.token_index(indptr, torch.tensor(sum(rows, [])))  # the dense decode description
    out, lse = mla_decode_ref(case.q[:, 0].double(), kv, att, Scales(case.preset.head_dim_v, case.preset.softmax_scale))
    torch.testing.assert_close(ref.out[:, 0], out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ref.lse[:, 0], lse, rtol=1e-12, atol=1e-12)


def test_the_sink_adds_exp_sink_minus_max_and_lse_leaves_it_out():
    case = small(V4, seq_lens=(1,))
    cap = capture(case)
    ref = sparse_reference(cap)
    k = case.main.values[int(case.indices[0, 0, 0])]
    s = case.q[0, 0].double() @ k * case.preset.softmax_scale  # [H] one entry per row
    torch.testing.assert_close(ref.out[0, 0], k[None] / (1 + torch.exp(case.sink.double() - s))[:, None])
    torch.testing.assert_close(ref.lse[0, 0], s)  # ln exp(s): natural log, the sink not in it


def test_a_row_with_no_valid_index_is_lonely_out_zero_lse_inf():
    case = small(V4, seq_lens=(1, 60))
    idx = case.indices.clone()
    idx[0] = -1  # every entry of request 0 invalid; its C4 list is already all -1 (length clamped to 1)
    ref = sparse_reference(capture(case, indices=idx))
    assert torch.equal(ref.out[0], torch.zeros_like(ref.out[0])) and bool(torch.isposinf(ref.lse[0]).all())
    assert bool(torch.isfinite(ref.lse[1]).all())


def test_inverse_rope_undoes_the_forward_rotation():
    g = torch.Generator().manual_seed(0)
    angles = torch.rand(10, 32, generator=g, dtype=torch.float64) * 6
    freqs = torch.stack([angles.cos(), angles.sin()], -1).flatten(-2)  # view_as_real(freqs_cis).flatten(-2)
    x = torch.randn(3, 2, 100, generator=g, dtype=torch.float64)
    pos = torch.tensor([0, 4, 9])
    xc = torch.view_as_complex(x[..., -64:].reshape(3, 2, 32, 2).contiguous())
    fwd = torch.view_as_real(xc * torch.polar(torch.ones_like(angles[pos]), angles[pos])[:, None]).flatten(-2)
    rotated = torch.cat([x[..., :-64], fwd], -1)
    torch.testing.assert_close(inverse_rope(rotated, freqs, pos), x)


def test_the_control_sits_at_bf16_noise():
    cap = capture(build_case(sparse_preset(V4)))
    ref, ctl = sparse_reference(cap), sparse_control(cap)
    err = (ctl.out - ref.out).abs() / ref.out.abs().amax(-1, keepdim=True)
    assert 0 < float(err.max()) < 2**-7  # a few bf16 ulps of each row's largest value, never zero


def test_validation_lists_every_inconsistency_one_line_each():
    case = small(V4)
    idx = case.indices.clone()
    idx[2, 0, 5] = 10**7  # past the cache
    lens = case.topk_length.clone()
    lens[1] = 999  # past the index width 128
    short = case.main.pages[:, :1000]  # fewer bytes than the layout needs per page
    found = [str(e) for e in problems(capture(case, indices=idx, topk_length=lens))]
    assert len(found) == 2 and all("\n" not in f for f in found)
    assert "tensor 'indices': [2, 0, 5] = 10000000 points past the cache" in found[0]
    assert "tensor 'topk_length': [1] = 999 is past the index width 128" in found[1]
    (bad,) = problems(capture(case, k_cache=short))
    assert "layout v4 needs 256 x 584" in str(bad)


def _write_unvalidated(path, case, **override):
    from safetensors.torch import save_file

    t = {k: v.contiguous() for k, v in {**case.tensors(), **override}.items()}
    save_file(t, str(path), metadata={"format": "refmla.capture/1", "meta": json.dumps(case.meta())})


def test_a_capture_with_indices_past_the_cache_exits_2_with_one_line(tmp_path, capsys):
    case = small(V4, seq_lens=(1, 60))
    idx = case.indices.clone()
    idx[1, 0, 3] = case.main.pages.shape[0] * 256 + 7
    path = tmp_path / "past.safetensors"
    _write_unvalidated(path, case, indices=idx)
    assert main(["replay", str(path), "--backend", "reference"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(path) in err[0] and "tensor 'indices'" in err[0] and "past the cache" in err[0]


def test_synth_then_replay_v4_flash_passes_reference_triton_observed(tmp_path, capsys):
    path = tmp_path / "x.safetensors"
    assert main(["synth", str(path), "--preset", V4]) == 0
    capsys.readouterr()
    assert main(["replay", str(path), "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    st = r["backends"]  # keyed by name, as every kind's (the one exception to "keys only added": docs/contract.md)
    assert r["verdict"] == "agree" and r["kind"] == "sparse_decode"
    assert [st[n]["status"] for n in ("reference", "observed", "triton")] == ["pass"] * 3
    assert st["triton"]["lse"]["status"] == "pass" and st["observed"]["lse"]["status"] == "pass"
    assert st["aiter_sparse"]["status"] == "skipped" and "aiter" in st["aiter_sparse"]["reason"]
    assert 0 < st["triton"]["max_abs_err"] and st["tilelang"]["status"] == "skipped"


def test_v32_is_not_a_triton_sparse_input(tmp_path):
    path = tmp_path / "v32.safetensors"
    synth_sparse(path, V32)
    r = replay_file(str(path), ReplayOptions(backends=["reference", "observed", "triton"]))
    st = r.backends
    assert r.verdict == "agree" and st["triton"].status == "skipped" and "V4 layout only" in st["triton"].reason


CASES = [(f, p) for p in (V4, V32) for f in FAULTS if APPLIES.get(f, lambda c: True)(build_case(sparse_preset(p)))]


@pytest.mark.parametrize("fault,preset", CASES)
def test_every_planted_sparse_fault_is_named_with_its_detail(tmp_path, fault, preset):
    """Production's output from refmla.sparse.faults' own plain loop (never the reference)."""
    path = tmp_path / "f.safetensors"
    synth_sparse(path, preset, fault)
    r = replay_file(str(path), ReplayOptions(backends=["reference", "observed"]))
    obs = r.backends["observed"]
    assert r.verdict == "diverged" and obs.status == "fail"
    hypothesis, detail = EXPECT[fault]
    assert obs.explanation is not None and obs.explanation.hypothesis == hypothesis, obs.explanation
    if fault == "topk_length_ignored":
        detail = {"scope": "both" if preset == V4 else "main"}  # V3.2 has one cache
    elif fault == "wrong_sm_scale":  # the ratio named: 1/sqrt(576) over the capture's softmax scale
        assert obs.explanation.detail["ratio"] == pytest.approx(576**-0.5 / sparse_preset(preset).softmax_scale, rel=1e-6)
        assert "1/sqrt(576)" in obs.explanation.extra["why"]
    elif fault == "output_rows_permuted":
        detail = {"rows": {1: 2, 2: 1}}
    elif fault == "other_rows_read":
        b, entry, meant, read = neighbour_entry(build_case(sparse_preset(preset)))
        detail = {"entry": entry, "cache": "main", "slot_read": read, "slot_meant": meant}
        assert obs.explanation.request == b
    assert obs.explanation.detail == (detail if detail is not None else obs.explanation.detail)


def test_a_clean_capture_round_trips_and_agrees(tmp_path):
    path = tmp_path / "c.safetensors"
    synth_sparse(path, "deepseek-v4-flash-tp8-c128")
    cap = read_sparse(path)
    assert cap.meta.compress_ratio == 128 and cap.meta.extra_page_size == 2 and cap.extra_indices.shape[2] == 64
    assert replay_file(str(path), ReplayOptions(backends=["reference", "observed"])).verdict == "agree"


def test_a_sparse_capture_carries_the_pools_regions_and_replay_checks_them(tmp_path):
    from refmla.capture import CaptureError
    from refmla.region_check import compressed_regions
    from refmla.sparse.validation import write_sparse

    case = small("deepseek-v4-flash-tp8-swa", seq_lens=(1, 60))
    regions = compressed_regions(23_448_064, 256, 1024, [0, 4, 128])  # the seed's DSV4-Flash run
    meta = {**case.meta(), **regions, "mori_max_mr_bytes": 4 << 30}
    write_sparse(tmp_path / "r.safetensors", case.tensors(), meta)
    r = replay_file(str(tmp_path / "r.safetensors"), ReplayOptions(backends=["reference"])).to_json()
    assert r["region"]["status"] == "finding" and r["region"]["bytes_per_token"] == 256
    assert r["region"]["region_bytes"] == 23_448_064 * 256
    with pytest.raises(CaptureError, match="kv_pool_region_item_bytes"):
        write_sparse(tmp_path / "bad.safetensors", case.tensors(), {**meta, "kv_pool_region_item_bytes": [1]})


def test_sparse_topk_is_one_group_per_query_row_main_then_extra():
    from refmla.attended import Attended

    idx = torch.tensor([[5, -1, 7, 9], [-1, -1, -1, -1]])
    extra = torch.tensor([[3, 4], [-1, 8]])
    a = Attended.sparse_topk(idx, torch.tensor([3, 4]), extra, torch.tensor([1, 2]))
    assert a.num_rows == a.num_groups == 2 and a.causal_len is None and a.mask is None
    assert a.group_rows(0).tolist() == [5, 7, 3] and a.group_pools(0).tolist() == [0, 0, 1]
    assert a.group_rows(1).tolist() == [8] and a.group_pools(1).tolist() == [1]
    one = Attended.sparse_topk(idx, None)
    assert one.pool_ids is None and one.lengths().tolist() == [3, 0]  # row 1 is lonely: an empty group
