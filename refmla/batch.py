"""Many captures: replayed one after the other or in worker processes, with the same result.

Every capture gets its report, in the order given: an unreadable one, or one on which refmla
itself fails, becomes an ``invalid`` report with its one-line reason, and the others still run.
A capture that kills its worker process is replayed once more alone; if that dies too, it is
reported ``invalid``.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Callable, Optional, Sequence

import torch

from refmla.backends.triton_interp import ensure_interpreter
from refmla.capture import CaptureError
from refmla.cp.replay import replay_step_files
from refmla.options import ReplayOptions, bound_problem
from refmla.kernel import InterfaceError
from refmla.progress import Progress
from refmla.pipeline import invalid_report, replay_file
from refmla.results import ReplayReport
from refmla.signals import ignore_sigint
from refmla.util import error_text


def replay_one(path: str, opts: ReplayOptions) -> ReplayReport:
    """replay_file that never raises: a crash of refmla itself becomes an ``invalid`` report."""
    try:
        return replay_file(path, opts)
    except InterfaceError as e:  # a kernel that does not meet refmla.kernel's interface: said as such
        return invalid_report(str(path), CaptureError(path, "kernel interface", str(e)))
    except Exception as e:  # one bad file must not end the run
        return invalid_report(str(path), CaptureError(path, "replay", error_text(e)))


Task = Callable[[str, ReplayOptions], Any]  # replay_one, or a picklable task that replays and does more


class WithSteps:
    """The task of a replay that holds context-parallel steps: a label in ``steps`` (label -> its
    ranks' files, refmla.cp.replay.group_steps) is that step judged as one call, any other path
    :func:`replay_one`. Picklable (a worker gets it whole)."""

    def __init__(self, steps: dict) -> None:
        self.steps = dict(steps)

    def __call__(self, path: str, opts: ReplayOptions) -> Any:
        files = self.steps.get(path)
        return replay_one(path, opts) if files is None else replay_step_files(path, files, opts)


def _isolated(task: Task, path: str, opts: ReplayOptions) -> Any:
    """``task(path, opts)``, or the capture's ``invalid`` report when it raises (any Exception,
    MemoryError included): one capture's failure is its own report, serial as in a worker."""
    try:
        return task(path, opts)
    except Exception as e:
        return invalid_report(str(path), CaptureError(path, "replay", error_text(e)))


def replay_many(paths: Sequence[str], opts: ReplayOptions, jobs: int = 1, task: Optional[Task] = None) -> list:
    """Reports for ``paths`` in their order; ``jobs`` > 1 replays in that many spawned processes.

    ``task`` (default :func:`replay_one`, never raising) runs per path, in the worker; a capture that
    kills its worker twice still gets an ``invalid`` ReplayReport whatever the task returns otherwise.
    Options out of their bounds (refmla.options) are a ValueError before any work.
    """
    opts.check()
    problem = bound_problem("jobs", jobs)
    if problem:
        raise ValueError(f"option jobs: {problem}")
    paths = [str(p) for p in paths]
    task = task or replay_one
    progress = Progress(len(paths))
    try:
        if jobs <= 1 or len(paths) <= 1:
            reports = []
            for i, p in enumerate(paths):
                reports.append(_isolated(task, p, opts))
                progress.step(p, i)
            return reports
        return _replay_parallel(paths, opts, jobs, progress, task)
    finally:
        progress.close()


def _init_worker(threads: int) -> None:
    """Runs first in every worker process: choose the Triton interpreter before triton is imported;
    leave SIGINT to the parent, which stops the workers itself (refmla.signals)."""
    ignore_sigint()
    ensure_interpreter()
    torch.set_num_threads(max(1, threads))


def _replay_parallel(paths: list[str], opts: ReplayOptions, jobs: int, progress: Progress, task: Task) -> list:
    """Workers are spawned (not forked), so each selects the Triton interpreter before importing triton."""
    reports: list[Optional[ReplayReport]] = [None] * len(paths)
    threads = max(1, (os.cpu_count() or 1) // max(1, jobs))
    died = _run_pool(paths, list(range(len(paths))), opts, jobs, threads, reports, progress, task)
    for i in died:  # the pool broke: whoever was running, plus everyone queued behind
        if _run_pool(paths, [i], opts, 1, threads, reports, progress, task):
            err = CaptureError(paths[i], "replay", "the worker process died replaying this capture")
            reports[i] = invalid_report(paths[i], err)
            progress.step(paths[i], i)
    return reports  # type: ignore[return-value]


def _run_pool(paths, todo, opts, jobs, threads, reports, progress, task=replay_one) -> list[int]:
    """Run ``todo`` in one pool; returns the indices whose future failed with a broken pool.

    A report that cannot come back (it does not pickle, ...) is that capture's ``invalid`` report,
    never the others'. SIGINT / SIGTERM (KeyboardInterrupt / Terminated) stop every worker before
    they propagate: no process outlives the command."""
    died = []
    pool = ProcessPoolExecutor(max_workers=min(jobs, len(todo)), mp_context=mp.get_context("spawn"),
                               initializer=_init_worker, initargs=(threads,))  # fmt: skip
    try:
        futs = {pool.submit(_isolated, task, paths[i], opts): i for i in todo}
        for fut in as_completed(futs):
            i = futs[fut]
            try:
                reports[i] = fut.result()
            except BrokenProcessPool:
                died.append(i)
                continue
            except Exception as e:  # the worker's report did not survive the trip back
                reports[i] = invalid_report(paths[i], CaptureError(paths[i], "replay", error_text(e)))
            progress.step(paths[i], i)
    except BaseException:
        _stop(pool)
        raise
    pool.shutdown(wait=True)
    return sorted(died)


def _stop(pool: ProcessPoolExecutor) -> None:
    """End the pool now: cancel what is queued, terminate the workers (kill the stubborn), reap them."""
    procs = list((getattr(pool, "_processes", None) or {}).values())
    pool.shutdown(wait=False, cancel_futures=True)
    for p in procs:
        with contextlib.suppress(Exception):
            p.terminate()
    for p in procs:
        with contextlib.suppress(Exception):
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    # the spawn context's resource tracker ends by itself once this process exits (its pipe closes)
