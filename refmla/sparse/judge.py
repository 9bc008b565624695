"""Judging a sparse path's output against the fp64 reference with the one comparator
(refmla.compare, docs/contract.md section 5): rows are query tokens (B * S), the tolerance comes
from the control at the kernels' rounding points; the lse where a path returns one: +inf on the
same (row, head)s, elsewhere within k times the control's lse error plus 4 fp32 ulps."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from refmla.compare import Comparison, Tolerance, compare
from refmla.sparse.format import SparseCapture
from refmla.sparse.reference import SparseOutput


@dataclass
class LseJudgement:
    passed: bool
    max_abs_err: float
    reason: Optional[str] = None

    def to_json(self) -> dict:
        return {"passed": self.passed, "max_abs_err": self.max_abs_err, "reason": self.reason}


def judge_out(name: str, cap: SparseCapture, out: torch.Tensor, ref: SparseOutput, ctrl: SparseOutput,
              tol: Tolerance) -> Comparison:  # fmt: skip
    B, S, H, Dv = ref.out.shape
    flat = lambda t: t.reshape(B * S, H, -1)  # noqa: E731 - [B, S, H, Dv] -> rows [R, H, Dv]
    return compare(name, flat(out), flat(ref.out), flat(ctrl.out), out_dtype=torch.bfloat16, tol=tol,
                   request_of_row=cap.request_of_row())  # fmt: skip


def judge_lse(lse: torch.Tensor, ref: SparseOutput, ctrl: SparseOutput, tol: Tolerance) -> LseJudgement:
    a, e, c = lse.double().reshape(ref.lse.shape), ref.lse, ctrl.lse
    inf_a, inf_e = torch.isposinf(a), torch.isposinf(e)
    if not torch.equal(inf_a, inf_e) or bool(torch.isnan(a).any()):
        n = int((inf_a != inf_e).sum()) + int(torch.isnan(a).sum())
        return LseJudgement(False, float("nan"), f"lse: +inf / NaN on {n} (row, head)s where the reference differs")
    fin = ~inf_e
    if not bool(fin.any()):
        return LseJudgement(True, 0.0)
    err = (a - e).abs()[fin]
    allowed = tol.k * (c - e).abs()[fin] + 4 * torch.finfo(torch.float32).eps * e.abs()[fin].clamp_min(1.0)
    worst = float(err.max())
    if bool((err > allowed).any()):
        return LseJudgement(False, worst, f"lse: {int((err > allowed).sum())} (row, head)s exceed k*control + 4 ulp, "
                                          f"worst error {worst:.3g}")  # fmt: skip
    return LseJudgement(True, worst)


__all__ = ["LseJudgement", "judge_lse", "judge_out"]
