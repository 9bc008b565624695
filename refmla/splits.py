"""The parts of a kernel's result besides ``out``: its stage-1 split partials against the split
reference (decode with SGLang's split schedule), and its lse against the reference's.

Each non-empty split s of request b has a normalized partial [H, Dv] and an lse [H]; the reference
computes the same split in fp64 and the control at the kernel's rounding points (fp32 partials), so
the partials are judged like an output: per (split, head) row, k times the control's error plus an
ulp of the value dtype (P.V ran on probabilities rounded to it). The lse must agree within k times
the control's lse error plus 1e-5 relative; so must a backend's final lse (the production ``lse``
for ``observed``), row by row against the reference and the control: both by
:func:`refmla.compare.judge_lse`, the one lse rule.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from refmla.arithmetic import Arithmetic
from refmla.compare import Comparison, Worst, compare, judge_lse, judged_dtype
from refmla.context import ReplayContext
from refmla.merging import LN2
from refmla.results import LseCheck, SplitCheck
from refmla.schedule import nonempty_splits


@dataclass
class SplitRows:
    """A kernel's stage-1 result row by row: one row per non-empty (request, split)."""

    b_idx: torch.Tensor  # [V] request of each row
    s_idx: torch.Tensor  # [V] split of each row
    cmp: Comparison  # the partials [V, H, Dv] (v_scale applied) against the split reference
    lse_err: torch.Tensor  # [V, H] |lse - reference lse|
    lse_bad: torch.Tensor  # [V, H] over k * control's lse error + 1e-5 relative
    misplaced: torch.Tensor  # [V, H] a NaN / Inf where the reference is finite (or the reverse)

    @property
    def partial_bad(self) -> torch.Tensor:
        """[V, H] partial rows over their allowance or with a misplaced NaN / Inf."""
        return ~(self.cmp.row_err <= self.cmp.row_tol) | self.misplaced


def split_rows(ctx: ReplayContext, res, splits: torch.Tensor, arith: Optional[Arithmetic] = None) -> Optional[SplitRows]:
    """The stage-1 partials of a BackendResult judged per (request, split, head) row, on the split
    schedule and at the rounding points its kernel declares (``arith``, default the result's or the
    producer's); None when no split holds a token."""
    arith = arith or res.arithmetic or ctx.producer
    S = res.attn_logits.shape[2]  # may be trimmed to the splits that hold tokens
    r_out, r_lse, valid = ctx.split_reference(splits, S, arith=arith)
    c_out, c_lse, _ = ctx.split_reference(splits, S, control=True, arith=arith)
    b_idx, s_idx = torch.nonzero(valid, as_tuple=True)  # [V] one row per non-empty split
    if len(b_idx) == 0:
        return None
    v = ctx.cap.meta.v_scale  # kernels store partials before v_scale
    actual = res.attn_logits.float().cpu()[b_idx, :, s_idx] * v  # [V, H, Dv]
    # partials are fp32 but P.V ran on P rounded to the value dtype: its ulp is the unit of noise
    value_dtype = ctx.cap.kv_buffer.dtype if ctx.cap.kv_buffer.dtype.itemsize < 4 else torch.float32
    if arith.dequant == "to_q_dtype" and value_dtype.itemsize < ctx.cap.q.dtype.itemsize:
        value_dtype = ctx.cap.q.dtype  # V dequantized to q's dtype, P rounded to it
    cmp = compare("splits", actual, r_out[b_idx, :, s_idx], c_out[b_idx, :, s_idx],
                  out_dtype=value_dtype, tol=ctx.opts.tol, request_of_row=b_idx)  # fmt: skip
    lse = judge_lse(res.attn_lse.cpu()[b_idx, :, s_idx], r_lse[b_idx, :, s_idx], c_lse[b_idx, :, s_idx], ctx.opts.tol.k)
    expected = r_out[b_idx, :, s_idx]
    misplaced = (torch.isfinite(actual) != torch.isfinite(expected)).any(-1)  # [V, H]
    return SplitRows(b_idx, s_idx, cmp, lse.err, lse.bad, misplaced)


def compare_splits(ctx: ReplayContext, res, arith: Optional[Arithmetic] = None) -> SplitCheck:
    """Stage-1 partials of a BackendResult against the split reference of the schedule its kernel
    declares (``arith``), per valid (request, split)."""
    arith = arith or res.arithmetic or ctx.producer
    if arith.split_block is None:
        return SplitCheck("skipped", reason="this kernel declares no split schedule to place its partials")
    splits = res.num_kv_splits if res.num_kv_splits is not None else ctx.cap.num_kv_splits
    if splits is None:
        return SplitCheck("skipped", reason="no num_kv_splits to place the partials")
    S = res.attn_logits.shape[2]
    lens = ctx.cap.seq_lens.tolist()
    needed = max((nonempty_splits(L, int(n), arith.split_block) for L, n in zip(lens, splits.tolist())), default=0)
    if needed > S:
        return SplitCheck("fail", reason=f"{needed} non-empty splits but only {S} partials")
    rows = split_rows(ctx, res, splits, arith)
    if rows is None:
        return SplitCheck("pass", compared_splits=0)
    b_idx, s_idx, cmp, lse_err, lse_bad = rows.b_idx, rows.s_idx, rows.cmp, rows.lse_err, rows.lse_bad
    row, head = divmod(int((cmp.row_err / cmp.row_tol).argmax()), cmp.row_err.shape[1])
    check = SplitCheck(
        "pass" if cmp.passed and not bool(lse_bad.any()) else "fail",
        compared_splits=len(b_idx),
        max_abs_err=cmp.max_abs_err,
        lse_max_abs_err=float(lse_err.max()),
        worst=Worst.of(request=int(b_idx[row]), head=head, split=int(s_idx[row])),
    )
    if check.status == "fail":
        bad = rows.partial_bad.any(dim=1) | lse_bad.any(dim=1)  # [V]
        check.failed_requests = sorted({int(b) for b in b_idx[bad]}) or [check.worst.request]
    if not cmp.passed:
        check.reason = "; ".join(cmp.reasons)
    elif bool(lse_bad.any()):
        r, h = (int(i) for i in torch.nonzero(lse_bad)[0])
        check.reason = f"lse of request {int(b_idx[r])} split {int(s_idx[r])} head {h} off by {lse_err[r, h].item():.3g}"
    return check


def compare_lse(
    ctx: ReplayContext, lse: torch.Tensor, out_dtype: torch.dtype, row_mask=None, control_lse=None,
    arith: Optional[Arithmetic] = None,
) -> LseCheck:  # fmt: skip
    """A backend's lse [R, H] against the reference's: within k times the control's lse error plus
    1e-5 * (1 + |lse|), NaN / Inf anywhere the reference is finite failing. ``row_mask`` [R]: rows
    compared (the others are zero-length requests the kernel leaves undefined). ``control_lse``
    [R, H]: the backend's own control's lse (BackendResult.control_lse), else the replay's. ``arith``:
    the kernel's declared arithmetic; an lse it declares in log2 is compared in ln (times ln 2)."""
    ref_lse = ctx.ref_lse.double()  # [R, H]
    rows = torch.ones(ref_lse.shape[0], dtype=torch.bool) if row_mask is None else row_mask.cpu()
    got = lse.detach().double().cpu()[rows]  # [r, H]
    if arith is not None and arith.lse_base == "log2":
        got = got * LN2
    ctl = ctx.control_lse(out_dtype) if control_lse is None else control_lse
    want, ctl = ref_lse[rows], ctl.double().cpu()[rows]
    if got.numel() == 0:
        return LseCheck("pass", compared_rows=0)
    judged = judge_lse(got, want, ctl, ctx.opts.tol.k)  # ctl: the kernel's own declared arithmetic, no other allowance
    err, bad = judged.err, judged.bad  # NaN err fails
    r, h = judged.worst()
    idx, req = torch.nonzero(rows).flatten(), ctx.cap.request_of_row()  # compared rows; [R] their requests
    row = int(idx[r])
    check = LseCheck("fail" if bool(bad.any()) else "pass", compared_rows=int(rows.sum()),
                     max_abs_err=float(err.max()),
                     worst=Worst.of(row=row, request=int(req[row]), head=h, actual=float(got[r, h]),
                                    expected=float(want[r, h])))  # fmt: skip
    if bool(bad.any()):
        check.failed_requests = sorted({int(req[i]) for i in idx[bad.any(dim=1)]})
        nonfinite = int((bad & ~torch.isfinite(got)).sum())
        check.reason = (f"{int(bad.sum())} of {got.numel()} values off (row {row} head {h}: "
                        f"{float(got[r, h]):.6g} vs {float(want[r, h]):.6g})"
                        + (f", {nonfinite} NaN/Inf" if nonfinite else ""))  # fmt: skip
    return check


def result_parts(ctx: ReplayContext, res, arith: Arithmetic, splits, row_mask=None) -> tuple[Optional[SplitCheck], Optional[LseCheck]]:
    """(split partials, lse) of a BackendResult judged as replay judges them, None for a part the
    kernel does not return: its stage-1 partials (decode) on the split schedule of ``arith``
    (:func:`compare_splits`), its lse against the reference at ``arith``'s lse base and its control
    over ``splits`` (:func:`compare_lse`; the backend's own control's lse where it brought one)."""
    parts = None
    if res.attn_logits is not None and res.attn_lse is not None and ctx.cap.is_decode:
        parts = compare_splits(ctx, res, arith)
    lse = None
    if res.lse is not None:
        dtype = judged_dtype(res.out.dtype)
        ctl = res.control_lse if res.control is not None else ctx.control_lse(dtype, arith, splits)
        lse = compare_lse(ctx, res.lse, dtype, row_mask=row_mask, control_lse=ctl, arith=arith)
    return parts, lse
