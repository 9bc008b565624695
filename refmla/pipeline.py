"""Replay: one capture through the backends, each compared with the fp64 reference.

    capture --read/validate--> metadata checks (refmla.checks)
            --> ReplayContext: reference (fp64), control (kernel rounding points)
            --> each backend: run, compare (refmla.compare), split partials (refmla.splits),
                explain a failure (refmla.hypotheses)
            --> verdict + diagnosis (refmla.diagnosis) --> ReplayReport (refmla.results)

A sparse decode capture (DeepSeek V3.2 / V4, refmla.sparse) takes the same steps into the same
ReplayReport (:func:`replay_sparse`): its rows (``Attended.sparse_topk``), its fp64 reference and
control over the packed caches, observed and its kernels by name (each kernel isolated), the one
comparator, the sparse mistakes' search, the localization of failing requests and heads, the
diagnosis; ``kind`` says which (``dense`` | ``sparse_decode``).
"""

from __future__ import annotations

import time
from typing import Any, Optional

import torch

from refmla.backends import (ALL_NAMES, NAMES, PAGED, VERIFY_ONLY, BackendUnavailable, get_backend, is_backend,
                             plugin_defaults)
from refmla.backends.base import BackendFinding, BackendResult
from refmla.capture import Capture, CaptureError, read_capture
from refmla.capture.kinds import file_mode
from refmla.checks import check_capture
from refmla.compare import judged_dtype
from refmla.context import ReplayContext, ReplayOptions
from refmla.diagnosis import (diagnose, diagnose_sparse, diagnose_upstream, diagnose_verify, is_decode_kernel,
                              unreplayed_path, verify_table)
from refmla.hypotheses import explain_failure
from refmla.hypotheses.sparse import explain_sparse
from refmla.indexer.chain import attach as attach_indexer
from refmla.indexer.io import read_indexer
from refmla.indexer.judge import judge_indexer
from refmla.kvwrite.io import read_kv_write
from refmla.kvwrite.judge import judge_kv_write
from refmla.merge.backends import BACKENDS as MERGE_BACKENDS
from refmla.indexer.backends import BACKENDS as INDEXER_BACKENDS
from refmla.merge.chunked_judge import judge_chunked
from refmla.merge.io import read_chunked, read_merge
from refmla.merge.judge import judge_merge
from refmla.nextsteps import after_observed
from refmla.isolation import KernelCrashed, KernelError, enabled, run_isolated
from refmla.kernel import InterfaceError
from refmla.localize import localize
from refmla.localize.entries import entry_spans
from refmla.repeat import compare_runs
from refmla.localize.types import Localization
from refmla.results import PART_NAMES, BackendEntry, MetadataReport, NoiseFloor, ReplayReport, Shape
from refmla.sparse.arithmetic import SGLANG_TRITON_SPARSE, SparseArithmetic
from refmla.sparse.backends import BACKENDS as SPARSE_BACKENDS
from refmla.sparse.backends import KERNELS as SPARSE_KERNELS
from refmla.sparse.backends import declared_arithmetic
from refmla.sparse.format import SPARSE_MODE, SparseCapture
from refmla.sparse.reference import SparseOutput, judge_lse, judge_out, rows_of, sparse_control, sparse_reference
from refmla.sparse.validation import is_sparse_file, nonfinite_inputs, read_sparse
from refmla.splits import compare_lse, compare_splits, result_parts
from refmla.util import dtype_name, error_text


# capture kinds with tensors of their own, by meta mode: (reader, judge) -> a ReplayReport
KINDS = {"kv_write": (read_kv_write, judge_kv_write), "merge": (read_merge, judge_merge),
         "chunked_prefill": (read_chunked, judge_chunked), "indexer": (read_indexer, judge_indexer)}


def replay_file(path: Any, opts: ReplayOptions) -> ReplayReport:
    """Replay one capture file. Never raises for bad input: returns an ``invalid`` report."""
    kind = KINDS.get(file_mode(path))
    sparse = kind is None and is_sparse_file(path)
    try:
        if kind is not None:
            return kind[1](kind[0](path), opts)
        cap = read_sparse(path) if sparse else read_capture(path)
    except CaptureError as e:
        report = invalid_report(str(path), e)
        report.kind = SPARSE_MODE if sparse else None
        return report
    return replay_sparse(cap, opts) if isinstance(cap, SparseCapture) else replay_capture(cap, opts)


def invalid_report(path: str, e: Exception) -> ReplayReport:
    """The report of a capture that could not be read or used: verdict ``invalid``, one line why."""
    d = diagnose({}, invalid=True)
    return ReplayReport(capture=path, verdict="invalid", diagnosis=d.name, diagnosis_text=d.text, error=str(e),
                        metadata=MetadataReport.invalid(str(e)))  # fmt: skip


def backend_names(opts: ReplayOptions, mode: str = "verify", engine: tuple = ()) -> list[str]:
    """reference and observed always; then the named backends, or all others but the opt-in ones (the
    verify-only per-query decode paths only for a verify capture) plus ``engine``: the producing
    engine's own kernel (:func:`engine_default`)."""
    default = [n for n in NAMES[2:] if mode == "verify" or n not in VERIFY_ONLY] + list(engine)
    default += list(plugin_defaults())  # the installed packages' kernels (entry points)
    chosen = default if opts.backends is None else [n for n in opts.backends if n not in NAMES[:2] and n not in SPARSE_ONLY]
    for n in chosen:
        if n not in MERGE_BACKENDS and n not in INDEXER_BACKENDS and not is_backend(n):  # merge / indexer captures' own
            raise KeyError(f"unknown backend {n!r}; choose from {', '.join(ALL_NAMES)}, or name your kernel "
                           "as module:function (docs/own-kernel.md)")  # fmt: skip
    others = (*MERGE_BACKENDS, *INDEXER_BACKENDS)  # a merge or indexer kernel is for its own kind of capture
    dense = [n for n in chosen if n in ALL_NAMES or (n not in others and is_backend(n))]
    return ["reference", "observed", *dict.fromkeys(dense)]


def engine_default(cap: Capture) -> tuple:
    """The producing engine's own kernel, replayed by default when it can run here (issue 27): vLLM's
    TRITON_MLA (``vllm_triton``) for a capture vLLM's Triton MLA wrote, and the block-table kernel
    the capture's meta ``backend`` names (``flashmla``, ``flashinfer_mla``, ``cutlass_mla``,
    ``fa3_mla``: what the vLLM hook writes for FLASHMLA, FLASHINFER_MLA, ...), opt-in otherwise."""
    m = cap.meta
    name = "vllm_triton" if m.engine_backend == "TRITON_MLA" else m.backend
    if m.mode == "decode" and name in ("vllm_triton", *PAGED):
        return (name,) if get_backend(name).availability()[0] else ()
    return ()


def replay_capture(cap: Capture, opts: ReplayOptions) -> ReplayReport:
    metadata = check_capture(cap)
    report = ReplayReport(
        capture=cap.path, verdict=None, diagnosis=None, metadata=metadata, mode=cap.meta.mode,
        shape=shape_of(cap), meta=cap.meta, tolerance=opts.tol, kind="dense",
    )  # fmt: skip
    if not metadata.ok:
        report.verdict = "invalid"
        d = diagnose({}, invalid=True)
        report.diagnosis, report.diagnosis_text = d.name, d.text
        return report
    ctx = ReplayContext(cap, opts)
    for name in backend_names(opts, cap.meta.mode, engine_default(cap)):
        report.backends[name] = run_backend(name, ctx)
    ctl = ctx.compare("control", ctx.control(cap.out_dtype))
    report.control = NoiseFloor(dtype_name(cap.out_dtype), ctl.max_abs_err, ctl.cos_diff)
    statuses = {n: b.status for n, b in report.backends.items()}
    explained = {n: (b.explanation.hypothesis, b.explanation.detail) for n, b in report.backends.items()
                 if b.status == "fail" and b.explanation is not None and b.explanation.complete}  # fmt: skip
    how = diagnose_verify if cap.is_verify else diagnose
    d = how(statuses, produced_by=cap.meta.backend, unreplayed=_unreplayed(cap, report.backends), explained=explained)
    report.diagnosis, report.diagnosis_text, report.diagnosis_backends = d.name, d.text, d.backends
    report.next_steps = after_observed(d.causes, cap.path, cap.meta, _agreeing_kernels(statuses)) or None
    if cap.is_verify:
        report.verify_vs_decode = verify_table(report.backends)
    report.diagnosis_text += parts_sentence(report.backends)
    report.verdict = "diverged" if any(s in ("fail", "error") for s in statuses.values()) else "agree"
    upstream = [f for f in metadata.findings if f.check == "nonfinite_input"]
    if upstream:  # NaN in, NaN out is no agreement: the finding outranks every backend's status
        report.verdict = "diverged"
        d = diagnose_upstream(upstream)
        report.diagnosis, report.diagnosis_text, report.diagnosis_backends = d.name, d.text, d.backends
        report.next_steps = None
    return report


def _agreeing_kernels(statuses: dict[str, str]) -> list[str]:
    return [n for n, s in statuses.items() if s == "pass" and is_decode_kernel(n)]


def _unreplayed(cap: Capture, backends: dict[str, BackendEntry]):
    """(aiter path production ran, why not replayed) or None: see refmla.diagnosis.unreplayed_path."""
    recorded = cap.meta.extra.get("aiter_path") if cap.meta.backend == "aiter" else None
    entry = backends.get("aiter")
    why = unreplayed_path(recorded, entry.status if entry else None, entry.info if entry else None,
                          entry.reason if entry else None)  # fmt: skip
    return (str(recorded), why) if why else None


def parts_sentence(entries: dict[str, BackendEntry]) -> str:
    """"; failing parts: observed lse, split partials" when a part besides ``out`` failed, else ""."""
    said = [f"{name} " + ", ".join(PART_NAMES[p] for p in e.failed_parts)
            for name, e in entries.items() if e.failed_parts]  # fmt: skip
    return f"; failing parts: {'; '.join(said)}" if said else ""


def shape_of(cap: Capture) -> Shape:
    return Shape(
        requests=cap.batch_size, rows=cap.q.shape[0], heads=cap.num_heads, head_dim=cap.meta.head_dim,
        v_head_dim=cap.meta.kv_lora_rank, q_dtype=dtype_name(cap.q.dtype), kv_dtype=dtype_name(cap.kv_buffer.dtype),
        max_seq_len=int(cap.seq_lens.max()) if cap.batch_size else 0,
    )  # fmt: skip


def run_backend(name: str, ctx: ReplayContext) -> BackendEntry:
    """Run one backend on the context's capture and judge it; never raises for the backend's sake."""
    t0 = time.perf_counter()
    if name == "reference":
        return BackendEntry("pass", max_abs_err=0.0, cos_diff=0.0,
                            info={"accum_dtype": "float64", "what": "the truth"})  # fmt: skip
    backend = get_backend(name)
    ok, why = backend.availability()
    if not ok:
        return BackendEntry("skipped", reason=why)
    try:
        wall = ctx.opts.kernel_seconds
        run = backend.run if not enabled(ctx.opts.isolate) else lambda c, o: run_isolated(backend.run, c, o, wall_s=wall)
        res = run(ctx.cap, ctx.opts)
        if ctx.opts.repeat > 1 and name != "observed":  # the same inputs again: every bit must match
            finding = repeated(res, [run(ctx.cap, ctx.opts) for _ in range(ctx.opts.repeat - 1)])
            res.findings += [finding] if finding else []
    except BackendUnavailable as e:
        return BackendEntry("skipped", reason=str(e))
    except (KernelCrashed, KernelError) as e:  # died or raised in its own process (refmla.isolation)
        return BackendEntry("error", reason=str(e), seconds=round(time.perf_counter() - t0, 3))
    except InterfaceError:  # not a kernel of refmla.kernel's interface: the caller's error (exit 2), no finding
        raise
    except Exception as e:  # a kernel that crashes is a finding, not a crash of refmla
        return BackendEntry("error", reason=error_text(e))
    mask = None if res.defines_empty_rows else ~ctx.empty_rows()
    arith = res.arithmetic or ctx.producer  # the kernel's own arithmetic (refmla.arithmetic): its control
    splits = res.num_kv_splits if res.num_kv_splits is not None else ctx.cap.num_kv_splits
    control = res.control if res.control is not None else ctx.control(judged_dtype(res.out.dtype), arith, splits)
    cmp = ctx.compare(name, res.out, row_mask=mask, control=control)
    entry = BackendEntry.judged(cmp, info={"version": why, **res.info, "arithmetic": arith.to_json()})
    if res.findings:
        fail_with(entry, res.findings)
    if mask is not None and not bool(mask.all()):
        entry.info["not_compared"] = "rows of zero-length requests (this path leaves them undefined)"
    entry.splits, entry.lse = result_parts(ctx, res, arith, splits, mask)  # the sweep judges them the same way
    entry.judge_parts()  # a failing lse or split partial fails the backend
    if entry.status == "fail" and ctx.opts.explain:
        try:  # where it goes wrong, explained or not (refmla.localize): an aid, never the replay's cost
            entry.localization = localize(ctx, res, entry)
        except Exception as e:
            entry.info["localize_error"] = error_text(e)
    if not cmp.passed and ctx.opts.explain:
        notes: dict = {}
        try:
            entry.explanation = explain_failure(ctx, res.out, cmp, notes)
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


# --------------------------------------------------------------------------------------------
# Sparse decode captures: the same report
# --------------------------------------------------------------------------------------------

SPARSE_ONLY = [n for n in SPARSE_KERNELS if n not in ALL_NAMES]  # aiter_sparse, tilelang: sparse captures only


def sparse_backend_names(opts: ReplayOptions) -> list[str]:
    """reference and observed always (observed is judged whatever the filter); then the sparse
    kernels named (a dense-only name is for the dense captures), or all of them."""
    chosen = SPARSE_KERNELS if opts.backends is None else [n for n in opts.backends if n in SPARSE_KERNELS]
    return ["reference", "observed", *dict.fromkeys(chosen)]


def replay_sparse(cap: SparseCapture, opts: ReplayOptions) -> ReplayReport:
    """One sparse decode capture through its paths into the one ReplayReport (module docstring)."""
    B, S, H, D = cap.q.shape
    rows = rows_of(cap)
    ref, ctrl = sparse_reference(cap, rows), sparse_control(cap, rows)
    findings = nonfinite_inputs(cap, ref.out, rows.lonely)
    m, K2 = cap.meta, None if cap.extra_indices is None else cap.extra_indices.shape[2]
    dims = {"B": B, "S": S, "H": H, "D": D, "Dv": m.head_dim_v, "K": cap.indices.shape[2], "K_extra": K2}
    shape = Shape(B, B * S, H, D, m.head_dim_v, dtype_name(cap.q.dtype), m.kv_fp8_dtype,
                  int(rows.valid.sum(1).max()) if B * S else 0, dims)  # fmt: skip
    report = ReplayReport(capture=cap.path, verdict=None, diagnosis=None, mode=SPARSE_MODE, kind=SPARSE_MODE, shape=shape,
                          metadata=MetadataReport(ok=True, warnings=list(cap.warnings) + [f.message for f in findings],
                                                  findings=findings), meta=m, tolerance=opts.tol)  # fmt: skip
    ctl = judge_out("control", cap, ctrl.out, ref, ctrl, opts.tol)
    report.control = NoiseFloor("bfloat16", ctl.max_abs_err, ctl.cos_diff)
    report.kind_keys = {"noise": float((ctrl.out - ref.out).nan_to_num().abs().max()) if ref.out.numel() else 0.0,
                        "lonely_rows": int(rows.lonely.sum()), "region": cap.region().to_json()}  # fmt: skip
    controls: dict[SparseArithmetic, SparseOutput] = {}
    for name in sparse_backend_names(opts):
        report.backends[name] = run_sparse_backend(name, cap, ref, ctrl, opts, controls)
    d = diagnose_sparse(report.backends, m.backend)
    report.diagnosis, report.diagnosis_text, report.diagnosis_backends = d.name, d.text, d.backends
    kernels_ok = [n for n, b in report.backends.items() if b.status == "pass" and n not in ("reference", "observed")]
    report.next_steps = after_observed(d.causes, cap.path, m, kernels_ok) or None
    statuses = [b.status for b in report.backends.values()]
    report.verdict = "diverged" if any(s in ("fail", "error") for s in statuses) else "agree"
    if findings:  # NaN in, NaN out is no agreement: the finding outranks every path's status
        report.verdict = "diverged"
        d = diagnose_upstream(findings)
        report.diagnosis, report.diagnosis_text, report.diagnosis_backends = d.name, d.text, d.backends
        report.next_steps = None
    attach_indexer(cap, report, opts)  # the indexer capture beside it, if any, judges the indices (refmla.indexer.chain)
    return report


def run_sparse_backend(name: str, cap: SparseCapture, ref: SparseOutput, ctrl: SparseOutput,
                       opts: ReplayOptions, controls: Optional[dict] = None) -> BackendEntry:  # fmt: skip
    """One path of a sparse capture, judged at its own declared arithmetic (``ctrl`` is SGLang's
    Triton kernel's control; another declaration's is built once into ``controls``) and (failing)
    explained and localized; a kernel runs in its own process (refmla.isolation): its crash is its
    ``error``, never the replay's."""
    t0 = time.perf_counter()
    if name == "reference":
        return BackendEntry("pass", max_abs_err=0.0, cos_diff=0.0, info={"accum_dtype": "float64", "what": "the truth"})
    run = SPARSE_BACKENDS[name]
    isolate = name in SPARSE_KERNELS and enabled(opts.isolate)
    call = (lambda: run_isolated(run, cap, wall_s=opts.kernel_seconds)) if isolate else (lambda: run(cap))
    finding = None
    try:
        got = call()
        if opts.repeat > 1 and name in SPARSE_KERNELS:  # the same inputs again: every bit must match (issue 31)
            finding = repeated(got, [call() for _ in range(opts.repeat - 1)])
    except BackendUnavailable as e:
        return BackendEntry("skipped", reason=str(e))
    except (KernelCrashed, KernelError) as e:  # died or raised in its own process
        return BackendEntry("error", reason=str(e), seconds=round(time.perf_counter() - t0, 3))
    except Exception as e:  # a kernel that crashes is a finding, not a crash of refmla
        return BackendEntry("error", reason=error_text(e))
    arith = declared_arithmetic(name, cap)
    if arith != SGLANG_TRITON_SPARSE:  # ctrl is that one's
        controls = {} if controls is None else controls
        if arith not in controls:
            controls[arith] = sparse_control(cap, rows_of(cap), arith=arith)
        ctrl = controls[arith]
    cmp = judge_out(name, cap, got.out, ref, ctrl, opts.tol, arith)
    entry = BackendEntry.judged(cmp, info={"version": got.note, **got.info, "arithmetic": arith.to_json()})
    if got.lse is not None:
        entry.lse = judge_lse(got.lse, ref, ctrl, opts.tol)
    entry.judge_parts()
    if finding is not None:  # a finding even within the tolerance
        fail_with(entry, [finding])
    if entry.status == "fail":
        entry.localization = _sparse_localization(cmp, entry, cap.q.shape[1])
        if opts.explain and cmp.row_failed is not None:
            try:  # which entries (cache, slot) bring the worst failing row of each request back: an aid
                failing = {}
                for r in torch.nonzero(cmp.row_failed.any(dim=1)).flatten().tolist():
                    failing.setdefault(r // cap.q.shape[1], []).append(r)
                order = {b: failing[b] for b in entry.localization.requests if b in failing}
                entry.localization.entries = entry_spans(cap, rows_of(cap), got.out, ref, ctrl, opts.tol, order)
                entry.localization.tried.append("entries: each top-k entry's removal, then each cache's")
            except Exception as e:
                entry.info["localize_error"] = error_text(e)
    if not cmp.passed and opts.explain:
        try:  # the search is an aid: its failure must not cost the replay
            notes: dict = {}
            entry.explanation = explain_sparse(cap, got.out, ref, ctrl, opts.tol, notes)
            search_notes(entry, notes)
        except Exception as e:
            entry.info["explain_error"] = error_text(e)
    entry.seconds = round(time.perf_counter() - t0, 3)
    return entry


def _sparse_localization(cmp, entry: BackendEntry, S: int) -> Localization:
    """The failing requests (worst first) and, per request, its failing heads (output and lse)."""
    heads: dict[int, set] = {}
    if cmp.row_failed is not None:
        for r, h in torch.nonzero(cmp.row_failed).tolist():
            heads.setdefault(r // S, set()).add(h)
    for b in (entry.lse.failed_requests or []) if entry.lse is not None else []:
        heads.setdefault(b, set())
    worst = cmp.worst.request if cmp.worst is not None else None
    reqs = sorted(heads, key=lambda b: (b != worst, b))
    return Localization(requests=reqs, heads={b: sorted(heads[b]) for b in reqs},
                        tried=["requests and heads from the comparator's failing rows"])


def worst_status(reports: list[ReplayReport]) -> int:
    """Exit code over reports: 2 invalid > 1 diverged > 0 agree."""
    return max((r.exit_code for r in reports), default=0)
