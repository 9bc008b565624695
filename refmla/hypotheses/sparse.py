"""The search of a sparse decode capture (DeepSeek V3.2 / V4): the numerics variants that apply to
sparse decode, tried by the dense mechanism (refmla.hypotheses.numerics: the same variants, names,
screening, row vote, comparator and detail), around the sparse mistakes (refmla.sparse.hypotheses).

The order is the dense search's: the rounding variants first (a store, the probabilities), then the
sparse and shared mistakes, then the accumulation variants (q.k or P.V summed in bf16 / fp16), which
are judged by their noise's size alone and would also fit a structured fault of that size. A
variant's control is the sparse control (refmla.sparse.reference.sparse_control) under the
variant's :class:`~refmla.control.Rounding`; its expectation is the fp64 reference unchanged. The
split variants (the lse stored narrow, the merges, ``split_lse_no_max``) do not apply: a sparse
capture records no split schedule.
"""

from __future__ import annotations

import time
from typing import Any, Optional

import torch

from refmla.compare import Tolerance, compare
from refmla.hypotheses.drivers import residual
from refmla.hypotheses.numerics import NAME, Trials, Variant, rows_fit, search_variants, variants_for
from refmla.results import Explanation
from refmla.sparse.format import SparseCapture
from refmla.sparse.hypotheses import explain, search_seconds, too_large_to_search
from refmla.sparse.reference import SparseOutput, rows_of, sparse_control
from refmla.util import error_text

OUT_DTYPE = VALUE_DTYPE = torch.bfloat16  # the sparse output, and the dtype the control rounds P to


class SparseTrials(Trials):
    """A sparse capture's variants: the control recomputed under each, the worst request first."""

    def __init__(self, cap: SparseCapture, out: torch.Tensor, ref: SparseOutput, ctrl: SparseOutput, tol: Tolerance):
        B, S, H, Dv = ref.out.shape
        self.cap, self.tol, self.S = cap, tol, S
        self.rows = rows_of(cap)
        self.out = out.detach().cpu().reshape(B * S, H, Dv)
        self.o64, self.ref, self.ctrl = self.out.double(), ref.out.reshape(B * S, H, Dv), ctrl.out.reshape(B * S, H, Dv)
        self.req_of_row = cap.request_of_row()
        self.cmp = self.judge(self.ref, self.ctrl, None)  # the output as the replay judged it
        worst = self.cmp.worst.request if self.cmp.worst is not None else None
        self.worst = int(worst) if worst is not None else 0

    def screen(self, v: Variant):
        b, S = self.worst, self.S
        ctl = sparse_control(self.cap, self.rows, v.rounding, slice(b, b + 1)).out
        rows = torch.arange(b * S, (b + 1) * S)
        return rows, self.ref[rows], ctl.reshape(len(rows), *ctl.shape[2:])

    def whole(self, v: Variant, rows, exp, ctl):
        return self.ref, sparse_control(self.cap, self.rows, v.rounding).out.reshape(self.ref.shape)

    def judge(self, expected, control, rows):
        out, req = (self.out, self.req_of_row) if rows is None else (self.out[rows], self.req_of_row[rows])
        return compare("hypothesis", out, expected, control, out_dtype=OUT_DTYPE, tol=self.tol, request_of_row=req)

    def vote(self, rows, expected, control, noisy):
        o, std = (self.o64, self.ctrl) if rows is None else (self.o64[rows], self.ctrl[rows])
        return rows_fit(o, std, control.double(), expected, None, noisy)

    def explained(self, detail, cmp, extra, alts) -> Explanation:
        b, S, bad = self.worst, self.S, self.cmp.row_failed  # the worst request and its failing heads
        heads = [] if bad is None else torch.nonzero(bad[b * S : (b + 1) * S].any(0)).flatten().tolist()
        return Explanation(hypothesis=NAME, request=b, detail=detail, max_abs_err=cmp.max_abs_err,
                           residual_ratio=residual(cmp), heads=heads, extra=extra, alternatives=alts)  # fmt: skip


def explain_sparse(cap: SparseCapture, out: torch.Tensor, ref: SparseOutput, ctrl: SparseOutput, tol: Tolerance,
                   notes: Optional[dict[str, Any]] = None) -> Optional[Explanation]:  # fmt: skip
    """The explanation of a diverging sparse output, or None: the rounding variants, the sparse
    mistakes (refmla.sparse.hypotheses.explain), the accumulation variants. ``notes`` as the dense
    search's: ``search_skipped`` (past the search's budget), ``numerics_tried`` (the variants tried
    and their residuals)."""
    if too_large_to_search(cap, rows_of(cap)) is not None:
        return explain(cap, out, ref, ctrl, tol, notes)  # says why in notes
    t, tried = SparseTrials(cap, out, ref, ctrl, tol), []
    if t.cmp.passed:
        return None
    variants, errors = variants_for(OUT_DTYPE, VALUE_DTYPE, splits=False), {}

    def numeric(late: bool) -> Optional[Explanation]:  # a half that raises is its error, the search goes on
        try:
            return search_variants(t, variants, tried, late)
        except Exception as e:
            errors[f"numerics.{'late' if late else 'early'}"] = error_text(e)
            return None

    said: dict[str, Any] = {} if notes is None else notes
    t0, budget = time.monotonic(), search_seconds()  # one budget for the whole search
    found = numeric(late=False) or explain(cap, out, ref, ctrl, tol, said, max(0.0, budget - (time.monotonic() - t0)))
    if found is None and "search_skipped" not in said:  # the late variants only within the search's budget
        found = numeric(late=True)
    if notes is not None and tried:
        notes["numerics_tried"] = tried
    if notes is not None and errors:
        notes["hypothesis_errors"] = errors
    return found


__all__ = ["SparseTrials", "explain_sparse"]
