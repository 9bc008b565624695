"""The dense kind: a token-slot or block-table capture (decode, extend, verify) of refmla.capture,
its fp64 reference and control in refmla.context.ReplayContext, the backends of refmla.backends,
the rows of zero-length requests where a kernel leaves them undefined, refmla.localize and the
hypothesis families of refmla.hypotheses."""

from __future__ import annotations

import dataclasses

from refmla.backends import ALL_NAMES, NAMES, PAGED, VERIFY_ONLY, get_backend, is_backend, plugin_defaults
from refmla.backends.base import Backend, BackendResult
from refmla.capture import Capture
from refmla.checks import check_capture
from refmla.compare import judged_dtype
from refmla.context import ReplayContext
from refmla.diagnosis import Diagnosis, diagnose, diagnose_verify, is_decode_kernel, unreplayed_path, verify_table
from refmla.hypotheses import explain_failure
from refmla.indexer.backends import BACKENDS as INDEXER_BACKENDS
from refmla.kinds.base import Judged, Kind
from refmla.localize import localize
from refmla.merge.backends import BACKENDS as MERGE_BACKENDS
from refmla.options import ReplayOptions
from refmla.results import PART_NAMES, BackendEntry, NoiseFloor, ReplayReport, Shape
from refmla.sparse.backends import SPARSE_ONLY
from refmla.splits import result_parts
from refmla.util import dtype_name


class DenseKind(Kind):
    name = "dense"

    def __init__(self, cap: Capture, opts: ReplayOptions, ctx: ReplayContext | None = None):
        self.cap, self.opts, self._ctx = cap, opts, ctx

    @classmethod
    def of(cls, ctx: ReplayContext) -> "DenseKind":
        return cls(ctx.cap, ctx.opts, ctx)

    @property
    def ctx(self) -> ReplayContext:
        if self._ctx is None:
            self._ctx = ReplayContext(self.cap, self.opts)
        return self._ctx

    def report(self) -> ReplayReport:
        cap = self.cap
        return ReplayReport(capture=cap.path, verdict=None, diagnosis=None, metadata=check_capture(cap), mode=cap.meta.mode,
                            shape=shape_of(cap), meta=cap.meta, tolerance=self.opts.tol, kind=self.name)  # fmt: skip

    def begin(self, report: ReplayReport) -> None:
        ctl = self.ctx.compare("control", self.ctx.control(self.cap.out_dtype))
        report.control = NoiseFloor(dtype_name(self.cap.out_dtype), ctl.max_abs_err, ctl.cos_diff)

    def backend_names(self) -> list[str]:
        return backend_names(self.opts, self.cap.meta.mode, engine_default(self.cap))

    def backend(self, name: str) -> Backend:
        return get_backend(name)

    def judge(self, name: str, res: BackendResult) -> Judged:
        ctx = self.ctx
        mask = None if res.defines_empty_rows else ~ctx.empty_rows()
        arith = res.arithmetic or ctx.producer  # the kernel's own arithmetic (refmla.arithmetic): its control
        splits = res.num_kv_splits if res.num_kv_splits is not None else ctx.cap.num_kv_splits
        control = res.control if res.control is not None else ctx.control(judged_dtype(res.out.dtype), arith, splits)
        cmp = ctx.compare(name, res.out, row_mask=mask, control=control)
        info = {"not_compared": "rows of zero-length requests (this path leaves them undefined)"} \
            if mask is not None and not bool(mask.all()) else {}  # fmt: skip
        split_check, lse = result_parts(ctx, res, arith, splits, mask)  # the sweep judges them the same way
        return Judged(cmp, arith, split_check, lse, info)

    def localize(self, res: BackendResult, entry: BackendEntry, judged: Judged):
        return localize(self.ctx, res, entry) if self.opts.explain else None

    def explain(self, res: BackendResult, judged: Judged, notes: dict):
        return explain_failure(self.ctx, res.out, judged.comparison, notes)

    def diagnose(self, backends: dict[str, BackendEntry]) -> Diagnosis:
        cap = self.cap
        statuses = {n: b.status for n, b in backends.items()}
        explained = {n: (b.explanation.hypothesis, b.explanation.detail) for n, b in backends.items()
                     if b.status == "fail" and b.explanation is not None and b.explanation.complete}  # fmt: skip
        how = diagnose_verify if cap.is_verify else diagnose
        d = how(statuses, produced_by=cap.meta.backend, unreplayed=_unreplayed(cap, backends), explained=explained)
        return dataclasses.replace(d, text=d.text + parts_sentence(backends))

    def agreeing(self, backends: dict[str, BackendEntry]) -> list[str]:
        return [n for n, b in backends.items() if b.status == "pass" and is_decode_kernel(n)]

    def finish(self, report: ReplayReport) -> None:
        if self.cap.is_verify:
            report.verify_vs_decode = verify_table(report.backends)


def backend_names(opts: ReplayOptions, mode: str = "verify", engine: tuple = ()) -> list[str]:
    """reference and observed always; then the named backends, or all others but the opt-in ones (the
    verify-only per-query decode paths only for a verify capture) plus ``engine``: the producing
    engine's own kernel (:func:`engine_default`)."""
    default = [n for n in NAMES[2:] if mode == "verify" or n not in VERIFY_ONLY] + list(engine)
    default += list(plugin_defaults(sparse=False))  # the installed packages' kernels (entry points; sparse ones: SparseKind's)
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


__all__ = ["DenseKind", "backend_names", "engine_default", "parts_sentence", "shape_of"]
