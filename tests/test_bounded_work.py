"""Work that follows what is attended, in blocks whose results are the whole's: the comparator in
blocks of rows, the positions' search from per-block sums (one pass, not two attentions a block).
No timings here (tools/bench_sparse.py measures them); the blocked results are checked against
the unblocked ones, and the verdicts on the big cases' shapes at small scale."""

from __future__ import annotations

import math

import pytest
import torch

from refmla import compare as cmp_mod
from refmla.compare import Tolerance, compare


def _outputs(R=37, H=3, Dv=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    e = torch.randn(R, H, Dv, generator=g, dtype=torch.float64)
    c = (e + 1e-3 * torch.randn(R, H, Dv, generator=g, dtype=torch.float64)).to(torch.bfloat16).double()
    a = e.to(torch.bfloat16)
    a[5, 1, 3] = a[5, 1, 3] * 3 + 1  # one row off
    a[20, 2, 7] = float("nan")  # a NaN the reference does not have
    e[30, 0, 1] = float("inf")  # an Inf the output does not have
    return a, e, c


@pytest.mark.parametrize("block", [1, 16, 48 * 5, 1 << 21])
def test_the_comparator_in_blocks_of_rows_gives_the_whole_verdict(monkeypatch, block):
    a, e, c = _outputs()
    req = torch.arange(37) // 2
    whole = compare("x", a, e, c, tol=Tolerance(), request_of_row=req)
    monkeypatch.setattr(cmp_mod, "COMPARE_BLOCK", block)  # rows of 48 elements: 1 row, 1 row, 5 rows, all
    got = compare("x", a, e, c, tol=Tolerance(), request_of_row=req)
    jw, jg = whole.to_json(), got.to_json()
    assert math.isclose(jw.pop("cos_diff"), jg.pop("cos_diff"), rel_tol=1e-12)
    assert jg == jw and not got.passed and got.nan_mismatch == 2
    for f in ("row_err", "row_tol", "row_failed", "row_nonfinite"):
        assert torch.equal(getattr(got, f), getattr(whole, f)), f
    assert got.row_failed[5, 1] and got.row_failed[20, 2] and got.row_failed[30, 0] and int(got.row_failed.sum()) == 3


def test_a_clean_output_passes_in_blocks(monkeypatch):
    a, e, c = _outputs()
    a = e.to(torch.bfloat16)
    a[30, 0, 1] = float("inf")
    monkeypatch.setattr(cmp_mod, "COMPARE_BLOCK", 48)
    got = compare("x", a, e, c)
    assert got.passed and got.failed_rows == 0 and got.compared_rows == 37 * 3


def _segment(L=3000, H=4, skipped=1234, seed=1):
    """A request of L positions whose kernel skipped one position (its output by a plain softmax
    here over the other positions), the allowance far below that position's weight."""
    from refmla.localize.positions import Segment
    from refmla.scales import Scales

    g = torch.Generator().manual_seed(seed)
    q = torch.randn(H, 576, generator=g, dtype=torch.float64)
    kv = torch.randn(L, 576, generator=g, dtype=torch.float64)
    kv[skipped, :64] += 0.4 * q[0, :64]  # a position that weighs in head 0
    sc = Scales(512, 576**-0.5)
    keep = torch.ones(L, dtype=torch.bool)
    keep[skipped] = False
    target = torch.zeros(H, 512, dtype=torch.float64)
    for h in range(H):  # plain softmax over the kept positions
        s = torch.stack([q[h] @ kv[x] for x in torch.nonzero(keep).flatten()]) * sc.sm_scale
        w = torch.exp(s - s.max())
        target[h] = (w[:, None] * kv[keep, :512]).sum(0) / w.sum()
    seg = Segment(request=0, offset=0, q=q, kv=kv, target=target, tol=torch.full((H,), 1e-9, dtype=torch.float64))
    seg.sc = sc
    return seg


def test_every_blocks_ratio_from_one_pass_is_the_whole_recomputations(monkeypatch):
    from refmla.localize import positions

    seg = _segment()
    calls, real = [], positions.Segment.ratio
    monkeypatch.setattr(positions.Segment, "ratio", lambda self, *a, **k: calls.append(a) or real(self, *a, **k))
    screened = positions.block_ratios(seg)
    # 47 blocks x (removed, zeroed): the peaks' blocks (4 heads) and the best recomputed, not all 94
    assert len(screened) == 2 * 47 and len(calls) <= 2 * 4 + positions.BISECT_CONFIRM + 2
    monkeypatch.setattr(positions.Segment, "ratio", real)
    for (blk, zero), r in screened.items():
        want = seg.ratio(blk, zero)
        assert math.isclose(r, want, rel_tol=1e-6, abs_tol=1e-5) or (math.isinf(r) and math.isinf(want)), (blk, zero, r, want)


def test_the_skipped_position_is_located_in_a_long_request():
    from refmla.localize.positions import locate

    span = locate(_segment())
    assert span is not None and span.start <= 1234 < span.end and span.end - span.start <= 64
    assert "removal restores" in span.how and (span.evidence is None or span.evidence == (1234, 1235))
