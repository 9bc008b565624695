"""One sparse decode capture through its compute paths: reference, control, each backend judged,
the failing ones explained, a verdict and the typed Diagnosis (:class:`SparseReport`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

from refmla.capture import CaptureError
from refmla.compare import Tolerance, Worst
from refmla.regions import RegionCheck
from refmla.diagnosis import Diagnosis
from refmla.sparse.backends import BACKENDS, DEFAULT_BACKENDS, Unavailable
from refmla.sparse.diagnosis import diagnose_sparse, invalid_diagnosis
from refmla.sparse.format import SparseCapture
from refmla.sparse.hypotheses import SparseExplanation, explain
from refmla.sparse.io import read_sparse
from refmla.sparse.judge import LseJudgement, judge_lse, judge_out
from refmla.sparse.reference import SparseOutput, rows_of, sparse_control, sparse_reference
from refmla.util import first_line

@dataclass
class SparseEntry:
    backend: str
    status: str  # "pass" | "FAIL" | "skipped" | "error"
    note: str = ""
    max_abs_err: Optional[float] = None
    cos_diff: Optional[float] = None
    worst: Optional[Worst] = None
    reasons: list = field(default_factory=list)
    lse: Optional[LseJudgement] = None
    explanation: Optional[SparseExplanation] = None
    info: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        worst = self.worst.to_json() if self.worst is not None else {}
        return {"backend": self.backend, "status": self.status, "note": self.note, "max_abs_err": self.max_abs_err,
                "cos_diff": self.cos_diff, "worst": worst, "reasons": self.reasons,
                "lse": self.lse.to_json() if self.lse else None,
                "explanation": self.explanation.to_json() if self.explanation else None, "info": self.info}  # fmt: skip


@dataclass
class SparseReport:
    capture: str
    verdict: str  # "agree" | "diverged" | "invalid"
    error: Optional[str] = None
    meta: dict = field(default_factory=dict)
    shape: dict = field(default_factory=dict)
    noise: Optional[float] = None  # the control's max abs error
    lonely_rows: int = 0
    entries: list = field(default_factory=list)
    diagnosis: Diagnosis = field(default_factory=invalid_diagnosis)  # class, sentence, backends (refmla.sparse.diagnosis)
    region: Optional[RegionCheck] = None  # the MR region check of the pool geometry in meta

    @property
    def exit_code(self) -> int:
        return {"agree": 0, "diverged": 1}.get(self.verdict, 2)

    def to_json(self) -> dict:
        return {"capture": self.capture, "kind": "sparse_decode", "verdict": self.verdict, "error": self.error,
                "meta": self.meta, "shape": self.shape, "noise": self.noise, "lonely_rows": self.lonely_rows,
                "backends": [e.to_json() for e in self.entries], "diagnosis": self.diagnosis.name,
                "diagnosis_text": self.diagnosis.text, "diagnosis_backends": self.diagnosis.backends,
                "region": self.region.to_json() if self.region else None}  # fmt: skip


def _judge(name: str, cap: SparseCapture, ref: SparseOutput, ctrl: SparseOutput, tol: Tolerance,
           explain_failures: bool) -> SparseEntry:  # fmt: skip
    try:
        got = BACKENDS[name](cap)
    except Unavailable as e:
        return SparseEntry(name, "skipped", str(e))
    except Exception as e:  # a kernel that crashes is a finding
        return SparseEntry(name, "error", f"{type(e).__name__}: {first_line(e)}")
    c = judge_out(name, cap, got.out, ref, ctrl, tol)
    lse = judge_lse(got.lse, ref, ctrl, tol) if got.lse is not None else None
    ok = c.passed and (lse is None or lse.passed)
    entry = SparseEntry(name, "pass" if ok else "FAIL", got.note, c.max_abs_err, c.cos_diff, c.worst,
                        c.reasons + ([lse.reason] if lse and lse.reason else []), lse, info=got.info)  # fmt: skip
    if not ok and explain_failures:
        entry.explanation = explain(cap, got.out, ref, ctrl, tol)
    return entry


def replay_sparse(path: str, backends: Optional[Sequence[str]] = None, tol: Tolerance = Tolerance(),
                  explain_failures: bool = True) -> SparseReport:  # fmt: skip
    try:
        cap = read_sparse(path)
    except CaptureError as e:
        return SparseReport(str(path), "invalid", error=str(e))
    rows = rows_of(cap)
    ref, ctrl = sparse_reference(cap, rows), sparse_control(cap, rows)
    names = [n for n in (backends or DEFAULT_BACKENDS) if n in BACKENDS]
    entries = [_judge(n, cap, ref, ctrl, tol, explain_failures) for n in names]
    verdict = "diverged" if any(e.status in ("FAIL", "error") for e in entries) else "agree"
    B, S, H, D = cap.q.shape
    noise = float((ctrl.out - ref.out).nan_to_num().abs().max())
    return SparseReport(str(path), verdict, meta=cap.meta.to_json(), shape={"B": B, "S": S, "H": H, "D": D,
                        "Dv": cap.meta.head_dim_v, "K": cap.indices.shape[2],
                        "K_extra": None if cap.extra_indices is None else cap.extra_indices.shape[2]},
                        noise=noise, lonely_rows=int(rows.lonely.sum()), entries=entries, diagnosis=diagnose_sparse(entries, cap.meta.backend),
                        region=cap.region())  # fmt: skip


__all__ = ["SparseEntry", "SparseReport", "replay_sparse"]
