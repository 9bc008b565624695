"""One merge capture judged: production's merged output (and lse) and each merge kernel against the
fp64 merge of the documented pieces, by the one comparator and the one lse rule; a failing output
explained (refmla.merge.hypotheses); as the shared :class:`refmla.results.ReplayReport` (backends
``reference``, ``observed``, the kernels; diagnosis ``merge`` or ``merge_kernel``)."""

from __future__ import annotations

import time
from typing import Any, Optional

import torch

from refmla.compare import Tolerance, compare, judge_lse
from refmla.merge.backends import BACKENDS, Unavailable
from refmla.merge.format import MergeCapture
from refmla.merge.hypotheses import explain
from refmla.merge.reference import control, reference
from refmla.results import BackendEntry, Explanation, Finding, LseCheck, MetadataReport, NoiseFloor, ReplayReport
from refmla.util import dtype_name, error_text

REFERENCE = BackendEntry("pass", max_abs_err=0.0, cos_diff=0.0, info={"accum_dtype": "float64", "what": "the truth"})


def lse_check(got: torch.Tensor, want: torch.Tensor, ctl: torch.Tensor, tol: Tolerance,
              request_of_row: Optional[torch.Tensor] = None) -> LseCheck:  # fmt: skip
    """The one lse rule on [T, H]; ``failed_requests`` the failing rows, or their requests when
    ``request_of_row`` [T] is given."""
    j = judge_lse(got, want, ctl, k=tol.k)
    n = int(j.bad.sum())
    if not n:
        return LseCheck("pass", compared_rows=int(want.shape[0]), max_abs_err=float(j.err.nan_to_num(0).max()))
    t, h = j.worst()
    rows = j.bad.nonzero()[:, 0]
    who = rows if request_of_row is None else request_of_row[rows]
    return LseCheck("fail", reason=f"{n} (row, head) lse off, worst row {t} head {h}: {float(got[t, h]):.6g} vs "
                    f"{float(want[t, h]):.6g}", compared_rows=int(want.shape[0]),
                    max_abs_err=float(j.err.nan_to_num(float('inf')).max()),
                    failed_requests=sorted({int(i) for i in who})[:16])  # fmt: skip


def merge_entry(name: str, cap: MergeCapture, out: torch.Tensor, lse: Optional[torch.Tensor], ref, ctl, tol: Tolerance,
                explain_failures: bool, info: dict, request_of_row: Optional[torch.Tensor] = None) -> BackendEntry:  # fmt: skip
    """One merged output (and lse) against the fp64 merge; a failure explained when asked.
    ``request_of_row`` [T]: the request of each row, for the report (default: the row)."""
    cmp = compare(name, out, ref[0], ctl[0], tol=tol, request_of_row=request_of_row)
    entry = BackendEntry.judged(cmp, info=info)
    if lse is not None:
        entry.lse = lse_check(lse, ref[1], ctl[1], tol, request_of_row)
    entry.judge_parts()
    if entry.status == "fail" and explain_failures:
        entry.explanation = both_empty_nan(cap, out, ref, ctl, tol) or explain(cap, tol)
    return entry


def both_empty_nan(cap: MergeCapture, out: torch.Tensor, ref, ctl, tol: Tolerance) -> Optional[Explanation]:
    """``merge_both_empty_nan``: the output is NaN exactly where both pieces are empty (0 / 0: no guard for
    max_lse = -inf, as SGLang's Triton merge) and agrees everywhere else; None otherwise."""
    both = cap.empty("a") & cap.empty("b")  # [T, H]
    if not bool(both.any()) or not bool(torch.isnan(out[both]).all()):
        return None
    nan = torch.tensor(float("nan"), dtype=torch.float64)
    want = torch.where(both[..., None], nan, ref[0].double())
    c = compare("both_empty_nan", out, want, torch.where(both[..., None], nan.to(ctl[0].dtype), ctl[0]), tol=tol)
    if not c.passed:
        return None
    rows = sorted({int(t) for t in both.nonzero()[:, 0]})
    return Explanation(hypothesis="merge_both_empty_nan", request=None, max_abs_err=c.max_abs_err,
                       detail={"rows": rows[:16], "pairs": int(both.sum()),
                               "why": "0 / 0: exp(lse - max) with max = -inf, no guard for two empty pieces"})  # fmt: skip


def _kernel(name: str, cap: MergeCapture, ref, ctl, tol: Tolerance) -> BackendEntry:
    t0 = time.perf_counter()
    try:
        out, lse = BACKENDS[name](cap)
    except Unavailable as e:
        return BackendEntry("skipped", reason=str(e))
    except Exception as e:  # a kernel that crashes is a finding
        return BackendEntry("error", reason=error_text(e))
    entry = merge_entry(name, cap, out, lse, ref, ctl, tol, False, {"lse_base": "e"})
    if entry.status == "fail":
        entry.explanation = both_empty_nan(cap, out, ref, ctl, tol)
    entry.seconds = round(time.perf_counter() - t0, 3)
    return entry


def judge_merge(cap: MergeCapture, opts: Any = None) -> ReplayReport:
    """The report of a readable capture; ``opts`` a ReplayOptions (tol, explain, backends by name)."""
    tol = getattr(opts, "tol", Tolerance())
    explain_failures = getattr(opts, "explain", True)
    names = [n for n in (getattr(opts, "backends", None) or BACKENDS) if n in BACKENDS]
    ref, ctl = reference(cap), control(cap)
    findings = [Finding("merge", "warning", w) for w in cap.warnings]
    entries = {"reference": REFERENCE,
               "observed": merge_entry("observed", cap, cap.out, cap.lse, ref, ctl, tol, explain_failures,
                                  {"merger": cap.meta.merger, "lse_base": cap.meta.lse_base})}  # fmt: skip
    for n in names:
        entries[n] = _kernel(n, cap, ref, ctl, tol)
    c = compare("control", ctl[0], ref[0])
    report = ReplayReport(capture=cap.path, verdict="agree", diagnosis=None, mode=cap.meta.mode, kind=cap.meta.mode, meta=cap.meta,  # type: ignore[arg-type]
                          metadata=MetadataReport(ok=True, warnings=[f.message for f in findings], findings=findings),
                          backends=entries, tolerance=tol, diagnosis_backends=[],
                          control=NoiseFloor(dtype_name(cap.out.dtype), c.max_abs_err, c.cos_diff))  # fmt: skip
    bad = [n for n, e in entries.items() if e.status in ("fail", "error")]
    if not bad:
        report.diagnosis_text = f"the merge ({cap.meta.merger}, lse base {cap.meta.lse_base}) agrees with the fp64 merge"
        return report
    report.verdict, report.diagnosis_backends = "diverged", bad
    obs = entries["observed"]
    if "observed" in bad:
        e = obs.explanation
        why = f"; {e.text()}" if e is not None else "; no simple merge mistake reproduces it"
        kernels = [n for n in names if entries[n].status == "pass"]
        agree = f" ({', '.join(kernels)} agree on the documented pieces)" if kernels else ""
        report.diagnosis = "merge"
        report.diagnosis_text = f"the merged output of {cap.meta.merger} differs from the fp64 merge{agree}: {obs.reason}{why}"
    else:
        report.diagnosis = "merge_kernel"
        report.diagnosis_text = f"merge kernel(s) {', '.join(bad)} diverge from the fp64 merge while production's output agrees"
    nan = [n for n in bad if entries[n].explanation is not None and entries[n].explanation.hypothesis == "merge_both_empty_nan"]
    if nan:
        d = entries[nan[0]].explanation.detail
        report.diagnosis_text += (f"; {', '.join(nan)} give NaN on the {d['pairs']} (row, head) where both pieces are "
                                  f"empty (rows {d['rows']}; {d['why']}), the documented row is out 0, lse -inf")  # fmt: skip
    return report


__all__ = ["both_empty_nan", "judge_merge", "lse_check", "merge_entry"]
