"""One indexer capture judged: the indices production produced and each engine's indexer code run
here, against the fp64 reference's top-k (refmla.indexer.reference), a wrong set explained
(refmla.indexer.hypotheses); as the shared :class:`refmla.results.ReplayReport` (backends
``reference``, ``observed``, the engines' code; diagnosis ``indexer`` or ``indexer_kernel``)."""

from __future__ import annotations

import time
from typing import Any, Optional

import torch

from refmla.compare import Tolerance
from refmla.indexer.backends import BACKENDS, Unavailable
from refmla.indexer.format import IndexerCapture
from refmla.indexer.hypotheses import explain
from refmla.indexer.reference import Scores, judge_sets
from refmla.results import BackendEntry, Finding, MetadataReport, ReplayReport
from refmla.util import error_text

REFERENCE = BackendEntry("pass", max_abs_err=0.0, cos_diff=0.0, info={"accum_dtype": "float64", "what": "the truth"})


def set_entry(cap: IndexerCapture, values: torch.Tensor, scores: Scores, explain_failures: bool, info: dict) -> BackendEntry:
    """One produced index set [B, K] judged; a wrong one explained when asked."""
    j = judge_sets(cap, values, scores)
    entry = BackendEntry("pass" if j.ok else "fail", reason=None if j.ok else j.text(),
                         info={**info, "index_sets": j.to_json()})  # fmt: skip
    if not j.ok and explain_failures:
        notes: dict = {}
        try:
            entry.explanation = explain(cap, values, j, scores, notes)
        except Exception as e:  # the search is an aid: its failure must not cost the judgement
            entry.info["explain_error"] = error_text(e)
        if notes.get("hypothesis_errors"):
            entry.info["hypothesis_errors"] = notes["hypothesis_errors"]
    return entry


def _kernel(name: str, cap: IndexerCapture, scores: Scores) -> BackendEntry:
    t0 = time.perf_counter()
    try:
        values = BACKENDS[name](cap)
    except Unavailable as e:
        return BackendEntry("skipped", reason=str(e))
    except Exception as e:  # engine code that crashes is a finding
        return BackendEntry("error", reason=error_text(e))
    entry = set_entry(cap, values, scores, False, {"engine_code": name})
    entry.seconds = round(time.perf_counter() - t0, 3)
    return entry


def judge_indexer(cap: IndexerCapture, opts: Any = None) -> ReplayReport:
    """The report of a readable indexer capture; ``opts`` a ReplayOptions (tol.k, explain, backends).
    An MTP capture (q [B, N, H, D]) is judged row by row (IndexerCapture.flat: each token its bound)."""
    cap = cap.flat()
    tol = getattr(opts, "tol", None) or Tolerance()
    explain_failures = getattr(opts, "explain", True)
    asked: Optional[list] = getattr(opts, "backends", None)
    names = [n for n in (asked if asked is not None else BACKENDS) if n in BACKENDS]
    scores = Scores(cap, tol.k)
    t0 = time.perf_counter()
    observed = set_entry(cap, cap.indices, scores, explain_failures, {"engine": cap.meta.engine})
    observed.seconds = round(time.perf_counter() - t0, 3)
    entries = {"reference": REFERENCE, "observed": observed, **{n: _kernel(n, cap, scores) for n in names}}
    findings = [Finding("indexer", "warning", w) for w in cap.warnings]
    report = ReplayReport(capture=cap.path, verdict="agree", diagnosis=None, mode=cap.meta.mode, kind=cap.meta.mode,
                          meta=cap.meta,  # type: ignore[arg-type]
                          metadata=MetadataReport(ok=True, warnings=[f.message for f in findings], findings=findings),
                          backends=entries, tolerance=tol, diagnosis_backends=[])  # fmt: skip
    report.kind_keys = {"noise": observed.info["index_sets"]["max_noise"], "topk": cap.meta.topk,
                        "compress_ratio": cap.meta.compress_ratio, "query_tokens": cap.next_n}  # fmt: skip
    bad = [n for n, e in entries.items() if e.status in ("fail", "error")]
    if not bad:
        report.diagnosis_text = f"the indexer's top-{cap.meta.topk} agrees with the fp64 reference's within its noise"
        return report
    report.verdict, report.diagnosis_backends = "diverged", bad
    if "observed" in bad:
        e = observed.explanation
        why = f"; {e.text()}" if e is not None else "; no simple indexer mistake reproduces it"
        ran = [n for n in names if entries[n].status == "pass"]
        agree = f" ({', '.join(ran)} chose right on the same inputs)" if ran else ""
        report.diagnosis = "indexer"
        report.diagnosis_text = f"the indexer chose the wrong entries{agree}: {observed.reason}{why}"
    else:
        report.diagnosis = "indexer_kernel"
        report.diagnosis_text = f"indexer code {', '.join(bad)} chooses wrong entries while production's indices are right"
    return report


__all__ = ["judge_indexer", "set_entry"]
