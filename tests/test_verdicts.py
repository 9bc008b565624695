"""The comparison's per-row verdicts (what the hypothesis search reads instead of re-deriving them)
and the one lse rule (refmla.compare.judge_lse) every lse check uses."""

from __future__ import annotations

import math

import torch

from refmla.compare import Tolerance, compare, judge_lse


def _truth_and_control(R=6, H=4, Dv=64, seed=3):
    g = torch.Generator().manual_seed(seed)
    truth = torch.randn(R, H, Dv, generator=g, dtype=torch.float64)
    return truth, truth.to(torch.bfloat16)


def test_row_verdicts_name_exactly_the_failing_rows():
    truth, control = _truth_and_control()
    bad = control.clone()
    bad[1, 2, 5] += 0.5  # over its allowance
    bad[3, 0, 7] = math.nan  # NaN where the reference is finite
    inf_truth = truth.clone()
    inf_truth[4, 1, 0] = math.inf
    bad[4, 1, 0] = -math.inf  # an Inf of the wrong sign (same placement, other sign)
    c = compare("k", bad, inf_truth, control)
    failed = {tuple(ij) for ij in torch.nonzero(c.row_failed).tolist()}
    assert failed == {(1, 2), (3, 0), (4, 1)}, failed
    assert not c.passed and c.row_failed.shape == (6, 4)


def test_row_verdicts_include_a_row_only_its_cosine_fails():
    truth, control = _truth_and_control(Dv=512)
    bad = control.clone()
    bad[2, 3] = -control[2, 3]  # the opposite direction: cosine difference 2
    wide = Tolerance(k=0.0, ulps=1e6, cos=1e-5)  # an allowance no error reaches: only the cosine can fail
    c = compare("k", bad, truth, control, tol=wide)
    assert c.failed_rows == 0 and not c.passed
    assert bool(c.row_failed[2, 3]) and int(c.row_failed.sum()) == 1


def test_row_verdicts_leave_masked_rows_out_and_pass_a_clean_output():
    truth, control = _truth_and_control()
    assert not bool(compare("k", control, truth, control).row_failed.any())
    bad = control.clone()
    bad[0] = math.nan
    mask = torch.ones(6, dtype=torch.bool)
    mask[0] = False
    c = compare("k", bad, truth, control, row_mask=mask)
    assert c.passed and not bool(c.row_failed.any())


def test_the_search_reads_the_comparisons_verdicts(tmp_path):
    """Search.bad_rows is the comparison's row_failed, whatever the comparison judged."""
    from refmla.capture import read_capture
    from refmla.context import ReplayContext, ReplayOptions
    from refmla.hypotheses.search import Search
    from refmla.synthetic import preset, synth_capture

    synth_capture(tmp_path / "c.safetensors", preset("hostile"), "seq_len_off_by")
    cap = read_capture(tmp_path / "c.safetensors")
    ctx = ReplayContext(cap, ReplayOptions(backends=[]))
    cmp = ctx.compare("observed", cap.out, row_mask=~ctx.empty_rows())
    s = Search(ctx, cap.out, cmp)
    assert torch.equal(s.bad_rows, cmp.row_failed) and bool(cmp.row_failed.any())
    assert s.failing and all(bool(cmp.row_failed[s.rows_of(b)].any()) for b in s.failing)


def test_lse_rule_non_finite_values_follow_the_outputs_rule():
    """NaN against NaN and the same infinity agree (the output's rule, issue 22); a NaN or an Inf
    against anything else fails."""
    want = torch.tensor([1.0, -math.inf, 2.0, math.nan, 3.0], dtype=torch.float64)
    got = torch.tensor([1.0, -math.inf, math.nan, math.nan, math.inf], dtype=torch.float32)
    j = judge_lse(got, want)
    assert j.bad.tolist() == [False, False, True, False, True]
    assert j.worst() in ((2,), (4,))


def test_lse_rule_widens_by_k_times_the_control():
    want = torch.tensor([10.0, 10.0], dtype=torch.float64)
    got = want + torch.tensor([1e-3, 1e-3], dtype=torch.float64)
    ctl = want + torch.tensor([1e-3, 1e-5], dtype=torch.float64)
    j = judge_lse(got, want, ctl, k=2.0)
    assert j.bad.tolist() == [False, True]  # 1e-3 <= 2 * 1e-3 + 1.1e-4; 1e-3 > 2 * 1e-5 + 1.1e-4
    assert bool(judge_lse(got, want, floor=torch.zeros(2)).bad.all())  # k 0, no floor: exact only
