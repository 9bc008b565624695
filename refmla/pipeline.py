"""Replay: one capture through the backends, each compared with the fp64 reference.

    capture --read/validate--> its kind (refmla.kinds: dense, block-table and sparse captures)
            --> report head, metadata checks; reference (fp64) and control (kernel rounding points)
            --> each backend: run (isolated, repeated), judged at its declared arithmetic's control
                with the one comparator, its parts (lse, split partials), localized and explained
                when it fails
            --> verdict + diagnosis (refmla.diagnosis) --> ReplayReport (refmla.results)

One path for every capture kind: what differs (the reference, the control for a declared
arithmetic, the backends, the rows, localization, the hypothesis families, the diagnosis) comes
from the capture's kind through :class:`refmla.kinds.base.Kind`; ``kind`` in the report says which
(``dense`` | ``sparse_decode``).
"""

from __future__ import annotations

import time
from typing import Any, Optional

from refmla.backends import ALL_NAMES  # noqa: F401  (the names a replay takes; patched by tests)
from refmla.backends.base import BackendFinding, BackendUnavailable
from refmla.capture import CaptureError
from refmla.capture.kinds import file_mode
from refmla.context import ReplayContext
from refmla.diagnosis import diagnose, diagnose_upstream
from refmla.indexer.io import read_indexer
from refmla.indexer.judge import judge_indexer
from refmla.isolation import KernelCrashed, KernelError, enabled, run_isolated
from refmla.kernel import InterfaceError
from refmla.kinds import SPARSE_ONLY, Kind, kind_of, read  # noqa: F401  (SPARSE_ONLY: the command line's)
from refmla.kinds import DenseKind, backend_names, engine_default, file_kind  # noqa: F401  (the API's)
from refmla.kvwrite.io import read_kv_write
from refmla.kvwrite.judge import judge_kv_write
from refmla.merge.chunked_judge import judge_chunked
from refmla.merge.io import read_chunked, read_merge
from refmla.merge.judge import judge_merge
from refmla.nextsteps import after_observed
from refmla.options import ReplayOptions
from refmla.repeat import compare_runs
from refmla.results import BackendEntry, MetadataReport, ReplayReport
from refmla.splits import compare_lse, compare_splits  # noqa: F401  (imported from here by callers)
from refmla.util import error_text


# capture kinds with tensors of their own, by meta mode: (reader, judge) -> a ReplayReport
KINDS = {"kv_write": (read_kv_write, judge_kv_write), "merge": (read_merge, judge_merge),
         "chunked_prefill": (read_chunked, judge_chunked), "indexer": (read_indexer, judge_indexer)}


def replay_file(path: Any, opts: ReplayOptions) -> ReplayReport:
    """Replay one capture file. Never raises for bad input: returns an ``invalid`` report."""
    own = KINDS.get(file_mode(path))
    try:
        if own is not None:
            return own[1](own[0](path), opts)
        cap = read(path)
    except CaptureError as e:
        report = invalid_report(str(path), e)
        report.kind = None if own is not None else file_kind(path)
        return report
    return replay_capture(cap, opts)


def invalid_report(path: str, e: Exception) -> ReplayReport:
    """The report of a capture that could not be read or used: verdict ``invalid``, one line why."""
    d = diagnose({}, invalid=True)
    return ReplayReport(capture=path, verdict="invalid", diagnosis=d.name, diagnosis_text=d.text, error=str(e),
                        metadata=MetadataReport.invalid(str(e)))  # fmt: skip


def replay_capture(cap: Any, opts: ReplayOptions) -> ReplayReport:
    """One capture (dense, block-table or sparse) through its backends into the one ReplayReport."""
    kind = kind_of(cap, opts)
    report = kind.report()
    if not report.metadata.ok:
        d = diagnose({}, invalid=True)
        report.verdict, report.diagnosis, report.diagnosis_text = "invalid", d.name, d.text
        return report
    kind.begin(report)
    for name in kind.backend_names():
        report.backends[name] = run_backend(name, kind)
    d = kind.diagnose(report.backends)
    report.diagnosis, report.diagnosis_text, report.diagnosis_backends = d.name, d.text, d.backends
    report.next_steps = after_observed(d.causes, cap.path, cap.meta, kind.agreeing(report.backends)) or None
    statuses = [b.status for b in report.backends.values()]
    report.verdict = "diverged" if any(s in ("fail", "error") for s in statuses) else "agree"
    upstream = [f for f in report.metadata.findings if f.check == "nonfinite_input"]
    if upstream:  # NaN in, NaN out is no agreement: the finding outranks every backend's status
        report.verdict = "diverged"
        d = diagnose_upstream(upstream)
        report.diagnosis, report.diagnosis_text, report.diagnosis_backends = d.name, d.text, d.backends
        report.next_steps = None
    kind.finish(report)
    return report


def run_backend(name: str, ctx: Kind | ReplayContext) -> BackendEntry:
    """Run one backend on the capture of ``ctx`` (a capture kind, or a dense capture's ReplayContext)
    and judge it; never raises for the backend's sake."""
    kind = ctx if isinstance(ctx, Kind) else DenseKind.of(ctx)
    cap, opts = kind.cap, kind.opts
    t0 = time.perf_counter()
    if name == "reference":
        return BackendEntry("pass", max_abs_err=0.0, cos_diff=0.0,
                            info={"accum_dtype": "float64", "what": "the truth"})  # fmt: skip
    backend = kind.backend(name)
    ok, why = backend.availability()
    if not ok:
        return BackendEntry("skipped", reason=why)
    try:
        wall = opts.kernel_seconds
        isolate = enabled(opts.isolate) and not backend.in_process
        run = backend.run if not isolate else lambda c, o: run_isolated(backend.run, c, o, wall_s=wall)
        res = run(cap, opts)
        if opts.repeat > 1 and name != "observed":  # the same inputs again: every bit must match
            finding = repeated(res, [run(cap, opts) for _ in range(opts.repeat - 1)])
            res.findings += [finding] if finding else []
    except BackendUnavailable as e:
        return BackendEntry("skipped", reason=str(e))
    except (KernelCrashed, KernelError) as e:  # died or raised in its own process (refmla.isolation)
        return BackendEntry("error", reason=str(e), seconds=round(time.perf_counter() - t0, 3))
    except InterfaceError:  # not a kernel of refmla.kernel's interface: the caller's error (exit 2), no finding
        raise
    except Exception as e:  # a kernel that crashes is a finding, not a crash of refmla
        return BackendEntry("error", reason=error_text(e))
    judged = kind.judge(name, res)  # at the control of its own declared arithmetic, over the kind's rows
    cmp = judged.comparison
    entry = BackendEntry.judged(cmp, info={"version": why, **res.info, "arithmetic": judged.arithmetic.to_json(),
                                           **judged.info})  # fmt: skip
    if res.findings:  # a finding even within the tolerance
        fail_with(entry, res.findings)
    entry.splits, entry.lse = judged.splits, judged.lse
    entry.judge_parts()  # a failing lse or split partial fails the backend
    if entry.status == "fail":
        try:  # where it goes wrong (refmla.localize): an aid, never the replay's cost
            entry.localization = kind.localize(res, entry, judged)
        except Exception as e:
            entry.info["localize_error"] = error_text(e)
    if not cmp.passed and opts.explain:
        notes: dict = {}
        try:
            entry.explanation = kind.explain(res, judged, notes)
            search_notes(entry, notes)
        except Exception as e:  # the search is an aid: its failure must not cost the replay
            entry.info["explain_error"] = error_text(e)
    entry.seconds = round(time.perf_counter() - t0, 3)
    return entry


def search_notes(entry: BackendEntry, notes: dict) -> None:
    """What the hypothesis search learnt besides its answer, into the entry's info (dense and sparse)."""
    if entry.explanation is None and notes.get("numerics_tried"):
        entry.info["numerics_tried"] = notes["numerics_tried"]  # the rounding variants ruled out
    if notes.get("hypothesis_errors"):  # families that raised: their errors, the others went on
        entry.info["hypothesis_errors"] = notes["hypothesis_errors"]
    if notes.get("search_skipped"):
        entry.info["search_skipped"] = notes["search_skipped"]  # requests past the search's budget


def repeated(res: Any, more: list) -> Optional[BackendFinding]:
    """Compare ``res`` (a dense or sparse backend's result) with the same backend's further runs bit
    for bit (refmla.repeat): the outcome in ``res.info["repeat"]``; a ``nondeterministic`` finding
    (a fail) when any bit differs."""
    parts = ("out", "lse", "attn_logits", "attn_lse")
    outcome = compare_runs([{p: t for p in parts if (t := getattr(r, p, None)) is not None} for r in (res, *more)])
    res.info["repeat"] = outcome.to_json()
    return None if outcome.deterministic else BackendFinding("nondeterministic", outcome.text(), outcome.to_json())


def fail_with(entry: BackendEntry, findings: list[BackendFinding]) -> None:
    """A finding is never a pass (e.g. aiter's rebuilt persistent metadata differs, a second run's
    bits): the entry fails with each finding's message, listed in ``info.findings`` (docs/contract.md
    section 3)."""
    entry.status = "fail"
    entry.reason = "; ".join([r for r in (entry.reason,) if r] + [f.message for f in findings])
    entry.info["findings"] = [f.to_json() for f in findings]


def worst_status(reports: list[ReplayReport]) -> int:
    """Exit code over reports: 2 invalid > 1 diverged > 0 agree."""
    return max((r.exit_code for r in reports), default=0)
