"""The sparse decode kind (DeepSeek V3.2 / V4, refmla.sparse): its rows (``Attended.sparse_topk``),
its fp64 reference and control over the packed caches (one control per declared arithmetic,
refmla.sparse.arithmetic), the sparse kernels as Backends (refmla.sparse.backends), the failing
requests and heads and the top-k entries that bring a row back (refmla.localize.entries), the
sparse mistakes' search (refmla.hypotheses.sparse), the indexer capture beside it."""

from __future__ import annotations

import torch

from refmla.backends.base import Backend, BackendResult
from refmla.diagnosis import Diagnosis, diagnose_sparse
from refmla.hypotheses.sparse import explain_sparse
from refmla.indexer.chain import attach as attach_indexer
from refmla.kinds.base import Judged, Kind
from refmla.localize.entries import entry_spans
from refmla.localize.types import Localization
from refmla.options import ReplayOptions
from refmla.results import BackendEntry, MetadataReport, NoiseFloor, ReplayReport, Shape
from refmla.sparse.arithmetic import SGLANG_TRITON_SPARSE, SparseArithmetic
from refmla.sparse.backends import KERNELS, SparseBackend, declared_arithmetic
from refmla.backends import is_sparse_kernel, plugin_defaults
from refmla.sparse.format import SPARSE_MODE, SparseCapture
from refmla.sparse.kernel import SparsePluginBackend
from refmla.sparse.reference import SparseOutput, judge_lse, judge_out, rows_of, sparse_control, sparse_reference
from refmla.sparse.validation import nonfinite_inputs
from refmla.util import dtype_name, error_text


def noise(ctrl: torch.Tensor, ref: torch.Tensor, rows: int = 4096) -> float:
    """The control's largest distance from the reference (NaN read as 0), ``rows`` request rows at a time."""
    n = ref.shape[0] * ref.shape[1]  # B * S query rows (0 heads: rows of nothing)
    c, r = ctrl.reshape(n, *ctrl.shape[2:]), ref.reshape(n, *ref.shape[2:])
    return max([float((c[i : i + rows] - r[i : i + rows]).nan_to_num_().abs_().max()) for i in range(0, c.shape[0], rows)
                if c[i : i + rows].numel()] or [0.0])  # fmt: skip


class SparseKind(Kind):
    name = SPARSE_MODE

    def __init__(self, cap: SparseCapture, opts: ReplayOptions):
        self.cap, self.opts = cap, opts
        self.rows = rows_of(cap)
        self.ref = sparse_reference(cap, self.rows)
        # SGLang's Triton kernel's control; another declaration's is built once, when a path declares it
        self.controls: dict[SparseArithmetic, SparseOutput] = {SGLANG_TRITON_SPARSE: sparse_control(cap, self.rows)}

    def control(self, arith: SparseArithmetic) -> SparseOutput:
        if arith not in self.controls:
            self.controls[arith] = sparse_control(self.cap, self.rows, arith=arith)
        return self.controls[arith]

    def report(self) -> ReplayReport:
        cap, rows, m = self.cap, self.rows, self.cap.meta
        B, S, H, D = cap.q.shape
        findings = nonfinite_inputs(cap, self.ref.out, rows.lonely)
        K2 = None if cap.extra_indices is None else cap.extra_indices.shape[2]
        dims = {"B": B, "S": S, "H": H, "D": D, "Dv": m.head_dim_v, "K": cap.indices.shape[2], "K_extra": K2}
        shape = Shape(B, B * S, H, D, m.head_dim_v, dtype_name(cap.q.dtype), m.kv_fp8_dtype,
                      int(rows.valid.sum(1).max()) if B * S else 0, dims)  # fmt: skip
        metadata = MetadataReport(ok=True, warnings=list(cap.warnings) + [f.message for f in findings], findings=findings)
        return ReplayReport(capture=cap.path, verdict=None, diagnosis=None, mode=SPARSE_MODE, kind=SPARSE_MODE,
                            shape=shape, metadata=metadata, meta=m, tolerance=self.opts.tol)  # fmt: skip

    def begin(self, report: ReplayReport) -> None:
        ref, ctrl = self.ref, self.controls[SGLANG_TRITON_SPARSE]
        ctl = judge_out("control", self.cap, ctrl.out, ref, ctrl, self.opts.tol)
        report.control = NoiseFloor("bfloat16", ctl.max_abs_err, ctl.cos_diff)
        report.kind_keys = {"noise": noise(ctrl.out, ref.out),
                            "lonely_rows": int(self.rows.lonely.sum()), "region": self.cap.region().to_json()}  # fmt: skip

    def backend_names(self) -> list[str]:
        """reference and observed always (observed is judged whatever the filter); then the sparse
        kernels named (a dense-only name is for the dense captures), or all of them and the installed
        packages' sparse top-k kernels (refmla.kernel layout sparse_topk)."""
        if self.opts.backends is None:
            chosen = [*KERNELS, *plugin_defaults(sparse=True)]
        else:
            chosen = [n for n in self.opts.backends if n in KERNELS or is_sparse_kernel(n)]
        return ["reference", "observed", *dict.fromkeys(chosen)]

    def backend(self, name: str) -> Backend:
        return SparseBackend(name) if name in KERNELS or name == "observed" else SparsePluginBackend(name)

    def judge(self, name: str, res: BackendResult) -> Judged:
        arith = res.arithmetic or declared_arithmetic(name, self.cap)  # each path at its own declaration
        ctrl = self.control(arith)
        cmp = judge_out(name, self.cap, res.out, self.ref, ctrl, self.opts.tol, arith)
        lse = judge_lse(res.lse, self.ref, ctrl, self.opts.tol) if res.lse is not None else None
        return Judged(cmp, arith, None, lse)

    def localize(self, res: BackendResult, entry: BackendEntry, judged: Judged) -> Localization:
        """The failing requests (worst first) and, per request, its failing heads (output and lse);
        explaining, which top-k entries (cache, slot) bring the worst failing row of each back."""
        cmp, S = judged.comparison, self.cap.q.shape[1]
        heads: dict[int, set] = {}
        if cmp.row_failed is not None:
            for r, h in torch.nonzero(cmp.row_failed).tolist():
                heads.setdefault(r // S, set()).add(h)
        for b in (entry.lse.failed_requests or []) if entry.lse is not None else []:
            heads.setdefault(b, set())
        worst = cmp.worst.request if cmp.worst is not None else None
        reqs = sorted(heads, key=lambda b: (b != worst, b))
        loc = Localization(requests=reqs, heads={b: sorted(heads[b]) for b in reqs},
                           tried=["requests and heads from the comparator's failing rows"])  # fmt: skip
        if self.opts.explain and cmp.row_failed is not None:
            try:  # an aid: its failure keeps the requests and heads
                failing: dict[int, list] = {}
                for r in torch.nonzero(cmp.row_failed.any(dim=1)).flatten().tolist():
                    failing.setdefault(r // S, []).append(r)
                order = {b: failing[b] for b in loc.requests if b in failing}
                ctrl = self.control(judged.arithmetic)
                loc.entries = entry_spans(self.cap, self.rows, res.out, self.ref, ctrl, self.opts.tol, order)
                loc.tried.append("entries: each top-k entry's removal, then each cache's")
            except Exception as e:
                entry.info["localize_error"] = error_text(e)
        return loc

    def explain(self, res: BackendResult, judged: Judged, notes: dict):
        ctrl = self.control(judged.arithmetic)  # the search's noise floor: the path's own declaration
        return explain_sparse(self.cap, res.out, self.ref, ctrl, self.opts.tol, notes)

    def diagnose(self, backends: dict[str, BackendEntry]) -> Diagnosis:
        return diagnose_sparse(backends, self.cap.meta.backend)

    def finish(self, report: ReplayReport) -> None:
        attach_indexer(self.cap, report, self.opts)  # the indexer capture beside it judges the indices (refmla.indexer.chain)


__all__ = ["SparseKind"]
