"""The one comparator: NaN placement, per-row allowance relative to the control, cosine."""

import math

import torch

from refmla.compare import Tolerance, compare, cos_diff, ulp


def _truth_and_control(R=6, H=8, Dv=512, seed=0):
    g = torch.Generator().manual_seed(seed)
    truth = torch.randn(R, H, Dv, generator=g, dtype=torch.float64)
    control = truth.to(torch.bfloat16)  # rounding noise of a bf16 output
    return truth, control


def test_ulp_of_bf16():
    assert ulp(torch.bfloat16, torch.tensor([1.0, 1.5, 2.0, 0.75], dtype=torch.float64)).tolist() == [
        2**-7, 2**-7, 2**-6, 2**-8]  # fmt: skip


def test_cos_diff_is_zero_for_equal_and_two_for_opposite():
    x = torch.randn(100, dtype=torch.float64)
    assert float(cos_diff(x, x)) == 0.0
    assert abs(float(cos_diff(x, -x)) - 2.0) < 1e-12
    assert float(cos_diff(torch.zeros(5), torch.zeros(5))) == 0.0


def test_rounded_output_passes():
    truth, control = _truth_and_control()
    c = compare("k", control, truth, control)
    assert c.passed and c.failed_rows == 0 and c.max_abs_err > 0


def test_one_bad_row_fails_and_is_the_worst():
    truth, control = _truth_and_control(R=64, H=16)
    bad = control.clone()
    bad[37, 9, 100] += 0.05  # a single element of a single (request, head) row
    c = compare("k", bad, truth, control)
    assert not c.passed and c.failed_rows == 1
    assert (c.worst.request, c.worst.head, c.worst.dim) == (37, 9, 100)
    assert c.cos_diff < 1e-5, "the whole-tensor cosine hides it; the row checks must not"


def test_nan_placement_must_match():
    truth, control = _truth_and_control()
    bad = control.clone()
    bad[2, 3, 4] = math.nan
    c = compare("k", bad, truth, control)
    assert not c.passed and c.nan_mismatch == 1 and c.worst.request == 2
    both = truth.clone()
    both[2, 3, 4] = math.nan
    assert compare("k", bad, both, control).nan_mismatch == 0


def test_masked_rows_are_not_compared():
    truth, control = _truth_and_control()
    bad = control.clone()
    bad[1] = math.nan
    mask = torch.ones(6, dtype=torch.bool)
    mask[1] = False
    assert compare("k", bad, truth, control, row_mask=mask).passed
    assert not compare("k", bad, truth, control).passed


def test_allowance_scales_with_the_control_and_k():
    truth, control = _truth_and_control()
    noisy = (truth + 3 * (control.double() - truth)).to(torch.float64)  # 3x the control's error
    assert not compare("k", noisy, truth, control, out_dtype=torch.bfloat16, tol=Tolerance(ulps=0)).passed
    assert compare("k", noisy, truth, control, out_dtype=torch.bfloat16, tol=Tolerance(k=4.0, ulps=0)).passed


def test_shape_mismatch_fails_cleanly():
    truth, control = _truth_and_control()
    c = compare("k", control[:, :4], truth, control)
    assert not c.passed and "shape" in c.reasons[0]
