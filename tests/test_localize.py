"""Localization (issue 21 part 2): every failing backend says where it goes wrong -- its failing
requests and heads, the positions, and for a split kernel the stage.

The split stages are tested on SGLang's own Triton kernel with one regression of ours planted in
one stage (tests/planted_sglang.py); the positions on a capture whose output a plain loop here
computed without one page (tests/helpers.dense_reference), not refmla's reference."""

from __future__ import annotations

import pytest
import torch

import planted_sglang
from helpers import dense_reference
from refmla.capture import read_capture, write_capture
from refmla.context import ReplayOptions
from refmla.localize.positions import Segment, locate
from refmla.reference import Scales
from refmla.pipeline import replay_capture
from refmla.schedule import split_bounds
from refmla.synthetic import make_inputs, make_meta, preset, synth_capture


@pytest.fixture(scope="module")
def stage_report(tmp_path_factory):
    """One replay of a hostile capture through the real kernel and the three planted ones."""
    path = tmp_path_factory.mktemp("loc") / "hostile.safetensors"
    synth_capture(path, preset("hostile"), "none")
    mp = pytest.MonkeyPatch()
    try:
        names = planted_sglang.register(mp, "stage1_mask", "stage1_lse", "stage2_merge")
        report = replay_capture(read_capture(path), ReplayOptions(backends=["triton", *names]))
    finally:
        mp.undo()
    return read_capture(path), report


@pytest.mark.parametrize("plant", ["stage1_mask", "stage1_lse", "stage2_merge"])
def test_a_regression_planted_in_one_stage_is_localized_to_it(stage_report, plant):
    cap, report = stage_report
    entry = report.backends[f"triton_{plant}"]
    assert entry.status == "fail"
    loc = entry.localization
    assert loc is not None and loc.stage == planted_sglang.STAGE[plant], loc.to_json()
    assert loc.requests and all(loc.heads[b] or b == loc.requests[-1] for b in loc.requests[:1])
    assert entry.to_json()["localization"]["stage"] == loc.stage
    if plant == "stage1_mask":  # every split lost its last position: each span is that position
        lens, splits = cap.seq_lens.tolist(), cap.num_kv_splits.tolist()
        narrowed = [s for s in loc.spans if s.end - s.start == 1]
        assert narrowed, loc.to_json()
        for s in narrowed:
            assert s.end == split_bounds(lens[s.request], splits[s.request])[s.split][1]
    if plant == "stage2_merge":
        assert loc.spans == []  # the partials are right: no position is to blame


def test_no_correct_kernel_is_flagged(stage_report):
    _, report = stage_report
    for name in ("triton", "observed"):
        assert report.backends[name].status == "pass" and report.backends[name].localization is None


@pytest.mark.parametrize("name,page", [("kimi-k2-tp8-page256", 1), ("deepseek-v3-tp8", 5), ("kimi-k2-tp8", None)])
def test_a_page_left_out_is_localized_to_that_page(tmp_path, name, page):
    """Request 2's output computed here with one page (page_size 1: positions 640..703) left out."""
    spec = preset(name)
    t = make_inputs(spec)
    P = spec.page_size
    start, end = (page * P, (page + 1) * P) if page is not None else (640, 704)
    b, Dv = spec.fault_request, spec.kv_lora_rank
    lo, hi = int(t["kv_indptr"][b]), int(t["kv_indptr"][b + 1])
    keep = torch.cat([t["kv_indices"][: lo + start], t["kv_indices"][lo + end :]])
    indptr = t["kv_indptr"].clone()
    indptr[b + 1 :] -= end - start
    out, _ = dense_reference(t["q"], t["kv_buffer"], indptr, keep, Dv, spec.sm_scale)
    t["out"] = out.to(spec.dtype)
    path = tmp_path / "c.safetensors"
    write_capture(path, t, make_meta(spec), compact=False)
    report = replay_capture(read_capture(path), ReplayOptions(backends=["reference"]))
    loc = report.backends["observed"].localization
    assert loc.requests == [b] and loc.stage is None, loc.to_json()
    (span,) = [s for s in loc.spans if s.request == b]
    assert (span.start, span.end) == (start, end), span
    if P > 1:
        assert span.pages == (page, page)
    assert "localized: request 2" in loc.text()


def test_positions_say_when_nothing_is_found():
    sc = Scales(4, 1.0)
    q, kv = torch.randn(2, 6, dtype=torch.float64), torch.randn(10, 6, dtype=torch.float64)
    seg = Segment(0, 0, q, kv, target=torch.full((2, 4), 100.0, dtype=torch.float64),
                  tol=torch.full((2,), 1e-3, dtype=torch.float64), sc=sc)  # fmt: skip
    assert locate(seg) is None  # no removal brings an output of 100s back


def test_the_demo_range_inside_a_block_is_localized(tmp_path):
    """The demo (`refmla synth --preset kimi-k2-tp8 --fault kv_range_zero`): positions 32..63 read as
    zeros, inside the first 64-position block whose removal makes the output worse (positions 0..31
    weigh most): the bisection's heads and tails find them."""
    path = tmp_path / "demo.safetensors"
    planted = synth_capture(path, preset("kimi-k2-tp8"), "kv_range_zero")
    report = replay_capture(read_capture(path), ReplayOptions(backends=["reference"]))
    loc = report.backends["observed"].localization
    (span,) = [s for s in loc.spans if s.request == planted["request"]]
    assert (span.start, span.end) == (planted["start"], planted["end"]) == (32, 64), loc.text()
    assert "positions 32..63" in loc.text() and "no positions found" not in loc.text()


def test_a_range_straddling_two_pages_is_localized(tmp_path):
    """DeepSeek-V3 page 64: positions 32..95 read as zeros (half of page 0, half of page 1): no whole
    page restores; the block shifted by half a page does, and the two pages are named."""
    spec = preset("deepseek-v3-tp8", num_heads=4, seq_lens=(300, 200, 420, 150))
    t = make_inputs(spec)
    b, Dv = spec.fault_request, spec.kv_lora_rank
    pool = t["kv_buffer"].clone()
    lo = int(t["kv_indptr"][b])
    pool[t["kv_indices"][lo + 32 : lo + 96].long()] = 0
    out, _ = dense_reference(t["q"], pool, t["kv_indptr"], t["kv_indices"], Dv, spec.sm_scale)
    t["out"] = out.to(spec.dtype)
    path = tmp_path / "c.safetensors"
    write_capture(path, t, make_meta(spec), compact=False)
    report = replay_capture(read_capture(path), ReplayOptions(backends=["reference"]))
    (span,) = [s for s in report.backends["observed"].localization.spans if s.request == b]
    assert (span.start, span.end, span.pages) == (32, 96, (0, 1)), span


@pytest.mark.parametrize("chunk", [None, 50])
def test_the_bisection_screen_ranks_as_the_reference_recomputes(monkeypatch, chunk):
    """_screen's prefix sums give the same ratio as Segment.ratio recomputing the attention, dropped
    and zeroed, on hostile data (a large logit range, a cap, fp8-like scales), in one chunk or many."""
    from refmla.localize import positions
    from refmla.localize.positions import _screen

    if chunk:
        monkeypatch.setattr(positions, "CHUNK", chunk)  # 50 values: 2 positions / ranges per chunk

    g = torch.Generator().manual_seed(3)
    sc = Scales(8, 0.7, logit_cap=5.0, k_scale=0.5, v_scale=2.0)
    q, kv = torch.randn(3, 12, generator=g, dtype=torch.float64) * 3, torch.randn(50, 12, generator=g, dtype=torch.float64)
    seg = Segment(0, 0, q, kv, target=torch.randn(3, 8, generator=g, dtype=torch.float64),
                  tol=torch.full((3,), 1e-2, dtype=torch.float64), sc=sc)  # fmt: skip
    starts, ends = torch.tensor([0, 5, 17, 40]), torch.tensor([3, 30, 18, 50])
    for zero in (False, True):
        want = torch.tensor([seg.ratio((int(a), int(e)), zero) for a, e in zip(starts, ends)], dtype=torch.float64)
        assert torch.allclose(_screen(seg, starts, ends, zero), want, rtol=1e-9), zero


def test_a_run_no_head_or_tail_of_a_block_matches_is_localized():
    """Positions 16..23 of a 40-position segment read as zeros, with an allowance so tight that any
    other row matters: no block, head or tail restores; every range is screened (projected) and
    the run found, narrowed to itself."""
    g = torch.Generator().manual_seed(4)
    sc = Scales(8, 0.3)
    q, kv = torch.randn(2, 12, generator=g, dtype=torch.float64), torch.randn(40, 12, generator=g, dtype=torch.float64)
    zeroed = kv.clone()
    zeroed[16:24] = 0
    target = torch.softmax(q @ zeroed.T * 0.3, -1) @ zeroed[:, :8]  # [2, 8], written out here
    seg = Segment(0, 0, q, kv, target=target, tol=torch.full((2,), 1e-9, dtype=torch.float64), sc=sc)
    span = locate(seg)
    assert span is not None and (span.start, span.end) == (16, 24), span
    assert "zeros" in span.how
