"""The sweep itself: walk the space within the budget (serially or in ``jobs`` spawned workers),
run every case through every backend's checks, then shrink each (backend, check) that failed,
write its capture, replay it, and name the axis value that triggers it.

    SweepConfig --walk (refmla.sweep.space)--> points --any_case--> cases --any_checks--> CaseResult
                --each failing (backend, check): shrink --> capture file --> refmla replay --> Finding

A backend sweeps the walked layouts it reads (refmla.sweep.kernels; without ``--backend`` each
layout's own default kernels); a dense case's capture is refmla.capture/1, a sparse case's the
sparse capture, an indexer case's an indexer capture, and ``refmla replay`` reads each.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shlex
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Optional, Sequence

from refmla.atomic import beside
from refmla.capture import write_capture
from refmla.compare import Tolerance
from refmla.options import ReplayOptions, bound_problem
from refmla.progress import Progress
from refmla.pipeline import replay_file
from refmla.sweep import budget
from refmla.sweep.bounds import Bounds, bounds_for
from refmla.sweep.budget import OVERRUN, UNSTARTED_IN_A_ROW, CostModel, work
from refmla.sweep.cases import capture_meta, capture_of
from refmla.sweep.checks import CHECKS, Evidence
from refmla.sweep.kernels import availability, not_read
from refmla.sweep.report import NOT_RUN, BackendSweep, CaseResult, CheckOutcome, Finding, SweepReport, trigger
from refmla.sweep.shrink import shrink
from refmla.sweep.space import LAYOUTS, NOT_YET, Walk, restrict
from refmla.sweep.indexer import IndexerSweepCase, write_indexer_capture
from refmla.sweep.sparse import SparseSweepCase, any_case, any_checks, write_sparse_capture
from refmla.sweep.workers import died, quiet_interpreter, run_setup, visible_gpus, worker_init
from refmla.util import error_text

SHRINK_SHARE = 0.15  # of the budget the walk leaves to shrinking once a check has failed
SKIPS_TO_DROP = 2  # consecutive skipped cases after which a backend is dropped from a layout
KERNEL_S_FLOOR = 120.0  # a forked kernel run is killed after max(this, budget / 5) seconds of wall time (it hangs)


@dataclass
class SweepConfig:
    """What ``refmla sweep`` is asked to do (its flags, docs/contract.md: the sweep)."""

    backends: Sequence[str] = ("triton",)
    budget: float = 60.0  # seconds of walking; shrinking follows, at most max_shrink runs per finding
    seed: int = 0
    out: str = "refmla-sweep"  # where the shrunk captures go
    jobs: int = 1
    repeat: int = 3  # runs compared bit for bit
    layouts: Sequence[str] = tuple(LAYOUTS)
    space: Sequence[str] = ()  # AXIS=V1,V2 restrictions
    checks: Sequence[str] = CHECKS  # which of the four checks run
    max_shrink: int = 24
    max_cases: Optional[int] = None  # stop the walk after this many cases (whatever the budget)
    tol: Tolerance = field(default_factory=Tolerance)
    setup: Optional[str] = None  # "module:function[:arg]" run first in every process (registers extra backends)
    # layout -> the backends it sweeps (refmla.sweep.kernels.LAYOUT_BACKENDS when --backend is not
    # given); None: every backend sweeps every walked layout it reads
    per_layout: Optional[dict] = None
    allow_skip: bool = False  # a named backend (per_layout None) that does not run on a layout it reads: exit 0, not 3
    sizes: Optional[str] = None  # the bounds' profile (refmla.sweep.bounds): cpu | gpu | production; None: where it runs
    limits: dict = field(default_factory=dict)  # bound -> value (--max-length ...), over the profile's
    bounds: Optional[Bounds] = None  # the bounds walked under (set from sizes and limits when the sweep starts)

    def walk_bounds(self) -> Bounds:
        """The bounds the walk keeps to: ``bounds`` where set, else ``sizes`` with ``limits``."""
        return self.bounds or bounds_for(self.sizes, **self.limits)

    def check(self) -> None:
        """ValueError naming the first bad option (the CLI's exit 2)."""
        if not self.budget > 0 or self.budget > 7 * 86400:
            raise ValueError(f"option budget: must be in (0, 604800] seconds, got {self.budget}")
        if not 2 <= self.repeat <= 1000:
            raise ValueError(f"option repeat: must be in [2, 1000], got {self.repeat}")
        problem = bound_problem("jobs", self.jobs)
        if problem:
            raise ValueError(f"option jobs: {problem}")
        if self.max_shrink < 0:
            raise ValueError(f"option max_shrink: must be >= 0, got {self.max_shrink}")
        bounds = self.walk_bounds()  # (ValueError for a bad profile or limit)
        for layout in self.layouts:
            restrict(layout, self.space, bounds)
        for check in self.checks:
            if check not in CHECKS:
                raise ValueError(f"option check: {check!r} is not one of {', '.join(CHECKS)}")

    def options(self) -> ReplayOptions:
        """The replay options every kernel run reads: production-width split buffers (no trim)."""
        return ReplayOptions(backends=list(self.backends), tol=self.tol, explain=False, trim=False,
                             kernel_seconds=max(KERNEL_S_FLOOR, self.budget / 5))  # past it: tried again, then an error


def evaluate(layout: str, point: dict, index: int, cfg: SweepConfig, backends: Sequence[str],
             deadline: Optional[float] = None) -> CaseResult:
    """One case through every check of every backend in ``backends``; past ``deadline`` (a
    refmla.sweep.budget.now() time) what is left is ``not run`` (a backend not started too)."""
    case = any_case(layout, point, cfg.seed, index, cfg.walk_bounds())
    res = CaseResult(index, layout, point, case.params())
    checks = any_checks(case, cfg.options(), cfg.repeat, deadline)
    for b in backends:  # the reference is computed once, in the first backend's time
        cut = next((o.detail for oc in res.outcomes.values() for o in oc.values() if o.status == NOT_RUN), None)
        if cut is not None:
            res.outcomes[b] = {c: CheckOutcome(c, NOT_RUN, cut) for c in cfg.checks}
            continue
        k0, r0 = checks.timing.kernel, checks.timing.reference
        res.outcomes[b], _ = checks.run(b, cfg.checks)
        res.kernel_seconds[b] = checks.timing.kernel - k0
        res.reference_seconds[b] = checks.timing.reference - r0
    return res


class Sweeper:
    def __init__(self, cfg: SweepConfig):
        self.t0 = budget.now()  # the budget counts from here: the backends' imports and availability are in it
        cfg.check()
        run_setup(cfg.setup)
        cfg = self.cfg = replace(cfg, bounds=cfg.walk_bounds())  # once: every worker walks the same bounds
        self.report = SweepReport(cfg.seed, cfg.budget, cfg.repeat, cfg.jobs, list(cfg.layouts),
                                  out_dir=str(cfg.out), not_walked=list(NOT_YET), asked=cfg.per_layout is None,
                                  allow_skip=cfg.allow_skip)  # fmt: skip
        for name in cfg.backends:
            self.report.backends[name] = self.backend_sweep(name)
        self.report.bounds = cfg.bounds.to_json()
        self.walks = [Walk(layout, restrict(layout, cfg.space, cfg.bounds), cfg.seed, cfg.bounds) for layout in cfg.layouts]
        self.counters = {w.layout: 0 for w in self.walks}
        self.skips: dict[tuple[str, str], int] = {}
        self.costs = CostModel()  # seconds per attended element, per (backend, layout), as timed in this run
        self.unstarted = 0  # points in a row predicted past the budget

    def backend_sweep(self, name: str) -> BackendSweep:
        """A backend's availability on each walked layout: available on one at least, the others
        in ``skipped_layouts`` with the reason (a sparse-only kernel on a dense layout, a layout's
        kernel that is not among its defaults); of those, the layouts it reads but cannot run on
        here in ``not_run`` too."""
        per = {layout: availability(name, layout) for layout in self.cfg.layouts}
        for layout in self.cfg.layouts:
            if per[layout][0] and self.cfg.per_layout is not None and name not in self.cfg.per_layout.get(layout, ()):
                per[layout] = (False, f"not among {layout}'s default kernels (name it with --backend)")
        usable = [why for ok, why in per.values() if ok]
        unrun = {la: why for la, (ok, why) in per.items() if not ok and not_read(name, la) is None}
        if not usable:
            reason = "; ".join(dict.fromkeys(why for _, why in per.values()))
            return BackendSweep(name, available=False, reason=reason, not_run=unrun)
        b = BackendSweep(name, available=True, reason="; ".join(dict.fromkeys(usable)), not_run=unrun)
        b.skipped_layouts = {layout: why for layout, (ok, why) in per.items() if not ok}
        return b

    def active(self, layout: str) -> list[str]:
        return [n for n, b in self.report.backends.items() if b.available and layout not in b.skipped_layouts]

    def points(self):
        """(layout, point, index) from each layout's walk in turn while some backend still takes
        it; a layout no backend takes is not walked (its coverage stays 0)."""
        its = {w.layout: iter(w) for w in self.walks}
        while True:
            live = [layout for layout in its if self.active(layout)]
            if not live:
                return
            for layout in live:
                if not self.active(layout):
                    continue
                point = next(its[layout])
                index = self.counters[layout]
                self.counters[layout] += 1
                yield layout, point, index

    def limit(self) -> float:
        """Seconds into the walk past which no case starts (less SHRINK_SHARE once a check has failed)."""
        return self.cfg.budget * (1 - SHRINK_SHARE if self.failing() else 1)

    def elements(self, layout: str, point: dict, index: int) -> int:
        return work(any_case(layout, point, self.cfg.seed, index, self.cfg.bounds))

    def next_point(self, points, done):
        """The next (layout, point, index) whose predicted cost (refmla.sweep.budget.CostModel)
        fits what is left of the walk: the others are counted in ``not_started``; None when the
        walk is done, or after UNSTARTED_IN_A_ROW points in a row that did not fit."""
        while not done():
            nxt = next(points, None)
            if nxt is None:
                return None
            layout, point, index = nxt
            left = self.t0 + self.limit() - budget.now()
            if self.costs.case_seconds(self.active(layout), layout, self.elements(layout, point, index)) <= left:
                self.unstarted = 0
                return nxt
            self.report.not_started[layout] = self.report.not_started.get(layout, 0) + 1
            self.unstarted += 1
            if self.unstarted >= UNSTARTED_IN_A_ROW:
                return None
        return None

    def record(self, res: CaseResult) -> None:
        self.report.cases.append(res)
        elements = None
        for name, outcomes in res.outcomes.items():
            if outcomes and not any(o.status == NOT_RUN for o in outcomes.values()):  # a whole run: timed
                elements = elements if elements is not None else self.elements(res.layout, res.point, res.index)
                seconds = res.kernel_seconds.get(name, 0.0) + res.reference_seconds.get(name, 0.0)
                self.costs.add(name, res.layout, elements, seconds)
        for name, outcomes in res.outcomes.items():
            b = self.report.backends[name]
            b.count(outcomes)
            b.kernel_seconds += res.kernel_seconds.get(name, 0.0)
            b.reference_seconds += res.reference_seconds.get(name, 0.0)
            key = (name, res.layout)
            if all(o.status == "skipped" for o in outcomes.values()):
                self.skips[key] = self.skips.get(key, 0) + 1
                if self.skips[key] >= SKIPS_TO_DROP:  # it reads the layout and did not run: not a pass
                    b.skipped_layouts[res.layout] = b.not_run[res.layout] = next(iter(outcomes.values())).detail
            else:
                self.skips[key] = 0

    def walk(self) -> None:
        """The cases within the budget (refmla.sweep.budget): none starts past it, nor one whose
        predicted cost passes what is left; a started case is cut off at budget x (1 + OVERRUN)
        (its unfinished checks ``not run``); once a check has failed, the walk leaves
        SHRINK_SHARE of the budget to shrinking (refmla.sweep.run.findings)."""
        t0, started = self.t0, budget.now()  # the budget's start (the sweep's), the walk's
        deadline = t0 + self.cfg.budget * (1 + OVERRUN)

        def done() -> bool:
            if self.cfg.max_cases is not None and len(self.report.cases) >= self.cfg.max_cases:
                return True
            return budget.now() - t0 >= self.limit()

        progress = Progress(self.cfg.max_cases or 2, unit="case")
        try:
            with quiet_interpreter():
                if self.cfg.jobs <= 1:
                    points = self.points()
                    while (nxt := self.next_point(points, done)) is not None:
                        layout, point, index = nxt
                        self.record(evaluate(layout, point, index, self.cfg, self.active(layout), deadline))
                        self._tick(progress, t0)
                else:
                    self._walk_parallel(done, progress, t0, deadline)
        finally:
            progress.close()
        self.report.walk_seconds = budget.now() - started
        self.report.cases.sort(key=lambda c: (self.cfg.layouts.index(c.layout), c.index))
        ran = {w.layout: [c.point for c in self.report.cases if c.layout == w.layout and
                          any(o.status != NOT_RUN for oc in c.outcomes.values() for o in oc.values())]
               for w in self.walks}  # fmt: skip
        self.report.pairs = {w.layout: [w.covered(ran[w.layout]), w.pairs_total] for w in self.walks if w.pairs_total}

    def failing(self) -> bool:
        return any(o.failed for r in self.report.cases for oc in r.outcomes.values() for o in oc.values())

    def _tick(self, progress: Progress, t0: float) -> None:
        """One case done: the total is the cases the budget holds at the pace so far (``max_cases``
        where it is smaller), never fewer than the cases done."""
        n, elapsed = len(self.report.cases), budget.now() - t0
        estimate = int(n * self.cfg.budget / elapsed) if elapsed > 0 else n
        progress.retotal(max(n, min(estimate, self.cfg.max_cases or estimate)))
        fails = len({(b, c) for r in self.report.cases for b, oc in r.outcomes.items() for c, o in oc.items() if o.failed})
        progress.step(f"{n} cases, {fails} failing checks, {elapsed:.0f} of {self.cfg.budget:g} s")

    def _walk_parallel(self, done, progress: Progress, t0: float, deadline: float) -> None:
        """``jobs`` workers, each a one-process pool of its own: worker i holds GPU i mod the
        visible ones where several are (refmla.sweep.run.visible_gpus), one case at a time; a
        worker that dies costs its case (an ``error`` finding) and is started again."""
        threads = max(1, (os.cpu_count() or 1) // self.cfg.jobs)
        ctx = mp.get_context("spawn")
        var, gpus = visible_gpus()

        def start(slot: int) -> ProcessPoolExecutor:
            gpu = (var, gpus[slot % len(gpus)]) if gpus else None
            init = (threads, self.cfg.setup, gpu)
            return ProcessPoolExecutor(1, mp_context=ctx, initializer=worker_init, initargs=init)

        pools = [start(slot) for slot in range(self.cfg.jobs)]
        pending: dict = {}  # future -> (layout, point, index, backends, slot)
        points = self.points()
        try:
            while True:
                busy = {v[-1] for v in pending.values()}
                for slot in (s for s in range(self.cfg.jobs) if s not in busy):
                    nxt = self.next_point(points, done)
                    if nxt is None:
                        break
                    layout, point, index = nxt
                    backends = self.active(layout)
                    fut = pools[slot].submit(evaluate, layout, point, index, self.cfg, backends, deadline)
                    pending[fut] = (layout, point, index, backends, slot)
                if not pending:
                    break
                finished, _ = wait(pending, return_when=FIRST_COMPLETED)
                for fut in finished:
                    layout, point, index, backends, slot = pending.pop(fut)
                    try:
                        self.record(fut.result())
                    except BrokenProcessPool:
                        self.record(died(layout, point, index, backends))
                        pools[slot].shutdown(wait=False, cancel_futures=True)
                        pools[slot] = start(slot)
                    self._tick(progress, t0)
        finally:
            for pool in pools:
                pool.shutdown(wait=False, cancel_futures=True)

    def findings(self) -> None:
        t0 = budget.now()
        out = Path(self.cfg.out)
        for name, b in self.report.backends.items():
            for check in self.cfg.checks:
                failing = [c for c in self.report.cases if name in c.outcomes and c.outcomes[name][check].failed]
                if failing:
                    b.findings.append(self.finding(name, check, failing, out))
        self.report.shrink_seconds = budget.now() - t0

    def finding(self, name: str, check: str, failing: list[CaseResult], out: Path) -> Finding:
        first = failing[0]
        f = Finding(name, check, first.outcomes[name][check].detail, first.index, first.layout, len(failing),
                    trigger=trigger(self.report.cases, name, check))  # fmt: skip
        case = any_case(first.layout, first.point, self.cfg.seed, first.index, self.cfg.bounds)
        try:
            with quiet_interpreter():  # the budget's end: shrinking stops there (the capture is still written)
                shrunk = shrink(case, name, check, self.cfg.options(), self.cfg.repeat, max_tries=self.cfg.max_shrink,
                                deadline=self.t0 + self.cfg.budget)  # fmt: skip
        except Exception as e:  # shrinking is an aid: the finding stands without it
            f.shrunk_detail = f"not shrunk: {error_text(e)}"
            return f
        if shrunk is None:
            f.shrunk_detail = "did not fail again when rerun (intermittent): not shrunk, no capture"
            return f
        f.shrunk, f.shrunk_detail, f.shrink_steps = shrunk.case.params(), shrunk.outcome.detail, shrunk.steps
        f.trigger = trigger(self.report.cases, name, check, shrunk_away(shrunk.steps)) or f.trigger
        path = out / f"{file_safe(name)}-{check}-{first.layout}-{first.index}.safetensors"
        sweep_meta = {"sweep": {"backend": name, "check": check, "seed": self.cfg.seed, "layout": first.layout,
                                "case": first.index, "point": first.point, "detail": shrunk.outcome.detail}}  # fmt: skip
        # a kernel that raised or crashed left no output: the capture holds the inputs, and its
        # replay reruns the kernel (its error is the verdict); else reference and observed only
        ev = shrunk.evidence or Evidence(None, None, shrunk.case)  # type: ignore[arg-type]
        try:
            path = beside(path)  # a file there that refmla did not write is kept: the capture goes beside it
            if isinstance(shrunk.case, SparseSweepCase):
                write_sparse_capture(path, ev, sweep_meta, name)
            elif isinstance(shrunk.case, IndexerSweepCase):
                write_indexer_capture(path, ev, sweep_meta, name)
            else:
                write_dense_capture(path, ev, sweep_meta, name)
        except Exception as e:
            f.shrunk_detail += f"; capture not written: {error_text(e)}"
            return f
        f.capture = str(path)
        f.replay_command = f"refmla replay {shlex.quote(str(path))} --backend {shlex.quote(name)}"
        try:
            rerun = [name] if shrunk.evidence is None or shrunk.evidence.rerun else []
            opts = replace(self.cfg.options(), backends=rerun)  # the sweep's wall-time limit: a kernel that spun spins again
            f.replay_verdict = replay_file(str(path), opts).verdict
        except Exception as e:
            f.replay_verdict = f"replay failed: {error_text(e)}"
        return f


def file_safe(name: str) -> str:
    """A backend's name in a file name: a kernel named by its path (``dir/kernel.py:decode``) keeps
    only letters, digits, ``.``, ``_`` and ``-``."""
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in name)


SHRUNK_AXES = {"requests": "batch", "request": "length", "heads": "heads"}  # a shrink step's first word -> its axis


def shrunk_away(steps: list[str]) -> frozenset:
    """The axes a shrink moved while the case kept failing ("requests 8 -> 1": batch; "request 0
    length 1023 -> 2" or "... context ...": length; "heads 32 -> 16": heads): not the trigger."""
    return frozenset(SHRUNK_AXES[s.split()[0]] for s in steps if s.split() and s.split()[0] in SHRUNK_AXES)


PRODUCERS = ("triton", "aiter", "vllm_triton")  # backend names a capture's meta ``backend`` says (others: unknown)


def write_dense_capture(path: Path, ev: Evidence, sweep_meta: dict, name: str) -> None:
    """The failing run's capture: the case's inputs, its output and the split counts it ran with;
    the producer named, on the split schedule the kernel declared (vLLM's uniform, SGLang's 32-token)."""
    tensors = capture_of(ev.case, out=ev.out, num_kv_splits=ev.num_kv_splits, extra=sweep_meta).tensors()
    meta = {**capture_meta(ev.case, sweep_meta), "backend": name if name in PRODUCERS else "unknown"}
    schedule = ev.arithmetic.split_schedule if ev.arithmetic is not None else None
    if schedule in ("sglang", "uniform") and "block_table" in tensors:
        meta["split_schedule"] = schedule
    write_capture(path, tensors, meta, compact=False)


def run_sweep(cfg: SweepConfig) -> SweepReport:
    """Walk, check, shrink: the whole ``refmla sweep``. ValueError for options out of bounds."""
    s = Sweeper(cfg)
    s.walk()
    s.findings()
    return s.report


__all__ = ["SweepConfig", "evaluate", "run_sweep", "visible_gpus"]
