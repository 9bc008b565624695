"""The four checks every case is run through, per backend, each reported by name:

    reference  the output against the fp64 reference under the tolerance (refmla.compare, the
               control's noise floor), buffers filled with 0 first; and the lse and the stage-1
               split partials wherever the kernel returns them, judged as replay judges them
               (refmla.splits.result_parts: at the lse base and split schedule it declares)
    nan_fill   the adapter's output and scratch buffers filled with NaN first: a value the kernel
               never wrote (a row, a split partial it reads) comes out NaN where the 0-filled run
               was finite, again on a second NaN-filled run and never on a second 0-filled one
               (else ``nondeterministic``: the fill does not decide it); n/a for a backend whose
               kernel allocates its own buffers; buffers it allocates inside (aiter's partials)
               are named as not poisoned
    repeat     N runs on the same inputs, compared bit for bit (refmla.repeat)
    splits     the kernel at two more split counts (1, and past every length: empty splits) where
               it takes one: failing at some counts and passing at others is an answer that moves
               with the split count past the tolerance (n/a for a kernel without a split count)

Kernels run as ``refmla replay`` runs them: in a child process (refmla.isolation), so a kernel
that crashes is that backend's ``error``, never the sweep's end; each is judged, as the replay
judges it, against the control at the arithmetic it declares (its split schedule and rounding
points, refmla.arithmetic). This module checks the dense layouts (decode, verify, block_table);
refmla.sweep.sparse checks the sparse one with the same four names.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional, Sequence

import torch

from refmla.arithmetic import Arithmetic
from refmla.backends import BackendUnavailable, get_backend
from refmla.backends.base import BackendResult
from refmla.compare import Comparison, compare, judged_dtype
from refmla.context import ReplayContext
from refmla.control import capture_control
from refmla.golden.cases import GoldenCase
from refmla.isolation import enabled
from refmla.kernel import InterfaceError
from refmla.options import ReplayOptions
from refmla.repeat import compare_runs, run_tensors
from refmla.results import PART_NAMES
from refmla.splits import result_parts
from refmla.sweep import budget
from refmla.sweep.budget import NOT_RUN, CutOff
from refmla.sweep.cases import capture_of, moved_pool, split_alternatives, with_splits
from refmla.sweep.report import CheckOutcome
from refmla.util import error_text

CHECKS = ("reference", "nan_fill", "repeat", "splits")


@dataclass
class Evidence:
    """The run that failed a check: what a capture of the failure holds as ``out``."""

    out: torch.Tensor
    num_kv_splits: Optional[torch.Tensor]
    case: GoldenCase  # the case of that run (its split counts; a sparse case: refmla.sweep.sparse)
    arithmetic: Optional[Arithmetic] = None  # what the kernel declared (None: the capture producer's)
    lse: Optional[torch.Tensor] = None  # the sparse kernels' lse, kept in their capture
    rerun: bool = False  # a part besides out failed: the capture's replay reruns the kernel


@dataclass
class Timing:
    kernel: float = 0.0  # seconds in the kernel's runs (child processes included)
    reference: float = 0.0  # seconds in the fp64 reference, the control and the comparisons


class CaseChecks:
    """One case, its reference computed once, checked against any number of backends."""

    def __init__(self, case: GoldenCase, opts: ReplayOptions, repeat: int = 3, deadline: Optional[float] = None):
        self.case, self.opts, self.repeat = case, opts, repeat
        self.deadline = deadline  # a budget.now() time: past it, what is left is not run (refmla.sweep.budget)
        self.timing = Timing()
        self.cap = capture_of(case)
        self._ctx: Optional[ReplayContext] = None
        self._moved = None  # the capture with its pool past int32 offsets, built once (a pool_base_row case)

    @property
    def ctx(self) -> ReplayContext:
        """The fp64 reference (and the control, on first use): computed once a kernel has run."""
        if self._ctx is None:
            if self.deadline is not None and budget.now() >= self.deadline:
                raise CutOff()
            t0 = budget.now()
            self._ctx = ReplayContext(self.cap, self.opts)
            self.timing.reference += budget.now() - t0
        return self._ctx

    def kernel(self, backend: str, case: GoldenCase, fill: float) -> BackendResult:
        """One run of ``backend`` on ``case`` (this case, or it at other split counts)."""
        b = get_backend(backend)
        cap = self.cap if case is self.case else capture_of(case)
        if case.pool_base_row:  # the pool past int32 element offsets (the reference keeps it compact)
            cap = self._moved if case is self.case and self._moved is not None else moved_pool(cap, case.pool_base_row)
            self._moved = cap if case is self.case else self._moved
        opts = replace(self.opts, buffer_fill=fill)
        t0 = budget.now()
        try:
            return budget.call(b.run, (cap, opts), opts.kernel_seconds, self.deadline, enabled(opts.isolate))
        finally:
            self.timing.kernel += budget.now() - t0

    def judge(self, name: str, res: BackendResult, case: GoldenCase) -> Comparison:
        """``res`` against the reference, with the control of ``case``'s split schedule at the
        arithmetic the kernel declares (as the replay judges it)."""
        t0 = budget.now()
        mask = None if res.defines_empty_rows else ~self.ctx.empty_rows()
        dtype = judged_dtype(res.out.dtype)
        arith = res.arithmetic or self.ctx.producer
        if res.control is not None:
            ctl = res.control
        elif case is self.case:
            splits = res.num_kv_splits if res.num_kv_splits is not None else self.cap.num_kv_splits
            ctl = self.ctx.control(dtype, arith, splits)
        else:
            ctl, _ = capture_control(capture_of(case), dtype, arith=arith, num_kv_splits=res.num_kv_splits)
        if case is self.case:
            cmp = self.ctx.compare(name, res.out, row_mask=mask, control=ctl)
        else:
            cmp = compare(name, res.out, self.ctx.ref_out, ctl.to(dtype), out_dtype=dtype, tol=self.opts.tol,
                          row_mask=mask, request_of_row=self.cap.request_of_row())  # fmt: skip
        self.timing.reference += budget.now() - t0
        return cmp

    def run(self, backend: str, only: Sequence[str] = CHECKS) -> tuple[dict[str, CheckOutcome], dict[str, Evidence]]:
        """The checks ``only`` (default all) of ``backend`` on this case; the failing runs' evidence."""
        why = refusal(backend, self.cap)
        if why:  # a point this kernel cannot take (an fp8 flavour, a cap): n/a here, never a skip that drops it
            return {c: CheckOutcome(c, "n/a", why) for c in only}, {}
        return run_checks(self, backend, only, lambda: self.kernel(backend, self.case, 0.0))

    def _evidence(self, res: BackendResult, case: GoldenCase) -> Evidence:
        return Evidence(res.out, res.num_kv_splits, case, res.arithmetic)

    def parts(self, res: BackendResult) -> dict[str, Any]:
        """The parts besides ``out`` that ``res`` returns (its lse, its split partials), judged as
        replay judges them (refmla.splits.result_parts): part name -> its check."""
        arith = res.arithmetic or self.ctx.producer
        splits = res.num_kv_splits if res.num_kv_splits is not None else self.cap.num_kv_splits
        mask = None if res.defines_empty_rows else ~self.ctx.empty_rows()
        t0 = budget.now()
        split, lse = result_parts(self.ctx, res, arith, splits, mask)
        self.timing.reference += budget.now() - t0
        return {name: c for name, c in (("lse", lse), ("attn_logits", split)) if c is not None}

    def _reference(self, backend: str, first: BackendResult):
        cmp = self.judge(backend, first, self.case)
        parts = self.parts(first)
        failed = {name: c for name, c in parts.items() if c.status == "fail"}
        data = {name: c.to_json() for name, c in parts.items()}
        if cmp.passed and not failed:
            said = "".join(f"; {PART_NAMES[n]} pass" for n, c in parts.items() if c.status == "pass")
            return CheckOutcome("reference", "pass", cmp.summary() + said, data), None
        reasons = ([] if cmp.passed else ["; ".join(cmp.reasons)]) + [
            f"{PART_NAMES[n]}: {c.reason or 'fail'}" for n, c in failed.items()]  # fmt: skip
        data = {"comparison": cmp.to_json(), **data, "failed_parts": (["out"] if not cmp.passed else []) + list(failed)}
        ev = self._evidence(first, self.case)
        ev.rerun = bool(failed)  # the capture's out alone does not show a wrong lse or partial: replay reruns the kernel
        return CheckOutcome("reference", "fail", "; ".join(reasons), data), ev

    def _nan_fill(self, backend: str, first: BackendResult):
        b = get_backend(backend)
        if not b.fills_buffers:
            return CheckOutcome("nan_fill", "n/a", "the kernel allocates its own output and scratch buffers"), None
        unpoisoned = f"; not poisoned: {b.unpoisoned}" if b.unpoisoned else ""
        poisoned = self.kernel(backend, self.case, math.nan)
        leaked = self._leaked(poisoned, first)
        n = int(leaked.sum())
        if not n:
            return CheckOutcome("nan_fill", "pass", "no value of the NaN fill reached the output" + unpoisoned), None
        # the fill decides it only if a second NaN-filled run leaks the same values and a second
        # 0-filled one does not: else the NaN came and went on its own (nondeterministic)
        again, zero = self.kernel(backend, self.case, math.nan), self.kernel(backend, self.case, 0.0)
        decided = torch.equal(self._leaked(again, first), leaked) and not bool(self._leaked(zero, first).any())
        row, head, dim = (int(i) for i in leaked.nonzero()[0])
        rows = int(leaked.any(dim=-1).any(dim=-1).sum())
        where = f"{n} output values are NaN with NaN-filled buffers and finite with 0-filled ones, in {rows} row(s); " \
                f"first at row {row} head {head} dim {dim}"  # fmt: skip
        why = ": a value the kernel never wrote" if decided else (
            "; not again on a rerun with the same fill, or NaN with 0-filled buffers too: nondeterministic, "
            "not decided by the fill (see repeat)")  # fmt: skip
        data = {"values": n, "rows": rows, "first": [row, head, dim], "kind": "unwritten" if decided else "nondeterministic"}
        return CheckOutcome("nan_fill", "fail", where + why + unpoisoned, data), self._evidence(poisoned, self.case)

    def _leaked(self, run: BackendResult, first: BackendResult) -> torch.Tensor:
        """[R, H, Dv] values non-finite in ``run`` and finite in ``first`` (rows the kernel defines)."""
        keep = torch.ones(first.out.shape[0], dtype=torch.bool)
        if not first.defines_empty_rows:
            keep = ~self.ctx.empty_rows()
        return (~torch.isfinite(run.out.float()) & torch.isfinite(first.out.float())) & keep[:, None, None]

    def again(self, backend: str) -> BackendResult:
        """Another run on the same inputs (the repeat check's)."""
        return self.kernel(backend, self.case, 0.0)

    def passes(self, backend: str, res: BackendResult) -> bool:
        return self.judge(backend, res, self.case).passed

    def kept(self, res: BackendResult) -> Evidence:
        return self._evidence(res, self.case)

    def _repeat(self, backend: str, first: BackendResult):
        return repeat_check(self, backend, first)  # the one repeat check, every case kind

    def _splits(self, backend: str, first: BackendResult):
        if first.num_kv_splits is None or self.case.mode != "decode":
            return CheckOutcome("splits", "n/a", "the kernel takes no split count"), None
        own = tuple(int(x) for x in first.num_kv_splits.tolist())
        verdicts = {own: self.judge(backend, first, self.case)}
        results = {own: (first, self.case)}
        for alt in dict.fromkeys(split_alternatives(self.case)):
            if alt in verdicts:
                continue
            case = with_splits(self.case, alt)
            res = self.kernel(backend, case, 0.0)
            verdicts[alt], results[alt] = self.judge(backend, res, case), (res, case)
        passed = {k: c.passed for k, c in verdicts.items()}
        said = ", ".join(f"{_counts(k)}: {'pass' if v else 'FAIL'}" for k, v in passed.items())
        if len(set(passed.values())) <= 1:
            return CheckOutcome("splits", "pass", f"the same verdict at every split count ({said})"), None
        bad = next(k for k, v in passed.items() if not v)
        text = f"the verdict moves with the split count ({said}); at {_counts(bad)}: {'; '.join(verdicts[bad].reasons)}"
        data = {"verdicts": {_counts(k): v for k, v in passed.items()}, "failing": list(bad)}
        res, case = results[bad]
        return CheckOutcome("splits", "fail", text, data), self._evidence(res, case)


def refusal(backend: str, cap) -> Optional[str]:
    """Why ``backend`` cannot take this capture's shape or scales, for a backend that says so
    before it runs (the NVIDIA block-table kernels' ``refuses``: an e4m3fnuz pool, a logit cap),
    or None."""
    refuses = getattr(get_backend(backend), "refuses", None)
    try:
        return refuses(cap) if callable(refuses) else None
    except Exception:  # the backend's own run says what is wrong
        return None


def run_checks(checker: Any, backend: str, only: Sequence[str], first_run: Callable[[], Any]):
    """The first run of ``backend``, then each check of ``only`` in CHECKS order
    (``checker._<check>(backend, first)``): (outcomes, the failing runs' evidence). A kernel that
    crashes or raises is its finding (the first check carries it, the others could not run); one
    that is unavailable is skipped; a case cut off at the budget's deadline (refmla.sweep.budget)
    leaves each check it had not finished ``not run``."""
    try:
        first = first_run()
    except CutOff as e:
        return {c: CheckOutcome(c, NOT_RUN, str(e)) for c in only}, {}
    except BackendUnavailable as e:
        return {c: CheckOutcome(c, "skipped", str(e)) for c in only}, {}
    except InterfaceError:  # not a kernel of refmla.kernel's interface: the sweep's usage error (exit 2)
        raise
    except Exception as e:  # a kernel that crashes or raises is its finding
        text = error_text(e)
        return {c: CheckOutcome(c, "n/a" if i else "error", text) for i, c in enumerate(only)}, {}
    outcomes: dict[str, CheckOutcome] = {}
    evidence: dict[str, Any] = {}
    cut: Optional[str] = None
    for check in [c for c in CHECKS if c in only]:
        if cut is not None:
            outcomes[check] = CheckOutcome(check, NOT_RUN, cut)
            continue
        try:
            outcome, ev = getattr(checker, f"_{check}")(backend, first)
        except CutOff as e:
            cut = str(e)
            outcome, ev = CheckOutcome(check, NOT_RUN, cut), None
        except BackendUnavailable as e:
            outcome, ev = CheckOutcome(check, "skipped", str(e)), None
        except InterfaceError:
            raise
        except Exception as e:
            outcome, ev = CheckOutcome(check, "error", error_text(e)), None
        outcomes[check] = outcome
        if ev is not None and outcome.status in ("fail", "error"):
            evidence[check] = ev
    return outcomes, evidence


def repeat_check(checker: Any, backend: str, first: Any):
    """``repeat``: ``first`` and ``checker.repeat - 1`` more runs (``checker.again``) compared bit for
    bit (refmla.repeat, out and lse); when they differ, the evidence is a differing run past the
    tolerance (``checker.passes``) when there is one (its capture replays diverged), else the first
    run that differs. The same for a dense and a sparse case (the checker supplies the three calls)."""
    runs = [first] + [checker.again(backend) for _ in range(max(1, checker.repeat - 1))]
    outcome = compare_runs([run_tensors(r) for r in runs])
    if outcome.deterministic:
        return CheckOutcome("repeat", "pass", outcome.text(), outcome.to_json()), None
    differs = [r for r in runs[1:] if not compare_runs([run_tensors(first), run_tensors(r)]).deterministic]
    wrong = [r for r in [first, *differs] if not checker.passes(backend, r)]
    shown = (wrong or differs)[0]
    return CheckOutcome("repeat", "fail", outcome.text(), outcome.to_json()), checker.kept(shown)


def _counts(splits: tuple[int, ...]) -> str:
    return f"splits {splits[0]}" if len(set(splits)) == 1 else f"splits {list(splits)}"


__all__ = ["CHECKS", "CaseChecks", "Evidence", "Timing", "refusal", "repeat_check", "run_checks"]
