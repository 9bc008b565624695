"""``refmla disagg``: the existing checks over a prefill node's and a decode node's captures, in order:

    plan      headers only: decode series by (layer, rank), each request's first decode capture
              and the prefill captures holding its rid (refmla.disagg.pairing)
    replay    every decode capture through every backend (refmla.batch.replay_many, ``jobs``
              worker processes); each report carries its metadata checks (refmla.checks).
              With ``jobs`` > 1 the diffs below run in this process meanwhile
    series    the decode captures of one (layer, rank) across steps (refmla.series.series_checks)
    diff-kv   each request's first decode capture against its prefill captures (refmla.diffkv.diff_kv)
    regions   the MR region-size check of every capture's pool geometry (refmla.regions)
    rows      one per (request, layer, rank), classified (refmla.disagg.classify)
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

from refmla.batch import replay_many
from refmla.capture import Capture, CaptureError, read_capture
from refmla.context import ReplayOptions
from refmla.diffkv import DiffResult, diff_kv
from refmla.disagg.cells import decode_cell, metadata_cell, request_index, transfer_cell
from refmla.disagg.classify import classify, overall
from refmla.disagg.foreign import foreign_source
from refmla.disagg.pairing import DisaggPlan, plan_disagg
from refmla.disagg.types import DisaggReport, Row
from refmla.regions import check_region
from refmla.render.progress import Progress
from refmla.results import ReplayReport
from refmla.series import series_checks
from refmla.util import single_thread


def run_disagg(prefill_paths: Sequence[str], decode_paths: Sequence[str], opts: ReplayOptions,
               jobs: int = 1) -> DisaggReport:  # fmt: skip
    """The whole disaggregated check (module docstring); never raises for one bad capture."""
    seconds: dict[str, float] = {}
    t0 = time.perf_counter()
    plan = plan_disagg([str(p) for p in prefill_paths], [str(p) for p in decode_paths])
    decode = [p for p in decode_paths if p in plan.decode]
    seconds["plan"] = time.perf_counter() - t0
    replay = _timed(seconds, "replay", replay_many, decode, opts, jobs=jobs)
    if jobs > 1:  # the replay runs in worker processes: diff meanwhile in this one
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(replay)
            diffs, entries = _timed(seconds, "diff_kv", _run_diffs, plan)()
            replays = pending.result()
    else:
        replays = replay()
        diffs, entries = _timed(seconds, "diff_kv", _run_diffs, plan)()
    series = _timed(seconds, "series", series_checks, decode)() if len(decode) > 1 else {}
    report = _assemble(plan, replays, series, diffs, entries)
    report.prefill, report.decode = list(prefill_paths), list(decode_paths)
    seconds["total"] = time.perf_counter() - t0
    report.seconds = {k: round(v, 3) for k, v in seconds.items()}
    return report


def _timed(seconds: dict, stage: str, fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` as a call of no arguments that records its wall time under ``stage``."""

    def call():
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            seconds[stage] = time.perf_counter() - t

    return call


def _run_diffs(plan: DisaggPlan) -> tuple[list[DiffResult], dict[tuple, object]]:
    """Every diff job; (rid, decode capture) -> that request's RequestDiff (or the error text).

    One torch thread, as diff_kv_files: reading validates with many small index operations."""
    with single_thread():
        return _diffs(plan)


def _diffs(plan: DisaggPlan) -> tuple[list[DiffResult], dict[tuple, object]]:
    read: dict[str, Capture] = {}

    def cap(path: str) -> Capture:
        if path not in read:
            read[path] = read_capture(path)
        return read[path]

    diffs, entries = [], {}
    progress = Progress(len(plan.jobs), unit="diff")
    try:
        for job in plan.jobs:
            try:
                result = diff_kv([cap(p) for p in job.prefill], cap(job.decode))
            except CaptureError as e:
                for rid in job.rids:
                    entries[(rid, job.decode)] = str(e)
                if e.path in plan.prefill and (e.path, str(e)) not in plan.invalid:
                    plan.invalid.append((e.path, str(e)))  # an unreadable prefill capture: exit 2
                progress.step(job.decode)
                continue
            diffs.append(result)
            prefill = [cap(p) for p in job.prefill]
            for rid in job.rids:
                try:
                    entry = result.request(rid)
                except KeyError:
                    entries[(rid, job.decode)] = "not paired by diff-kv"
                    continue
                source = None
                if not entry.faithful and entry.paired and (entry.first_run is None or entry.first_run.offset is None):
                    source = foreign_source(entry, prefill, cap(job.decode))
                entries[(rid, job.decode)] = (entry, source)
            progress.step(job.decode)
            read.pop(job.decode, None)  # a decode capture is diffed once
    finally:
        progress.close()
    return diffs, entries


def _assemble(plan: DisaggPlan, replays: list[ReplayReport], series: dict, diffs: list[DiffResult],
              entries: dict) -> DisaggReport:  # fmt: skip
    by_path = {r.capture: r for r in replays}
    invalid = list(plan.invalid) + [(r.capture, r.error or "; ".join(r.metadata.errors))
                                    for r in replays if r.verdict == "invalid"]  # fmt: skip
    regions = [("prefill", p, check_region(h.meta)) for p, h in plan.prefill.items()]
    regions += [("decode", p, check_region(h.meta)) for p, h in plan.decode.items()]
    region_of = {p: c for _, p, c in regions}
    rows: list[Row] = []
    for (layer, rank), paths in plan.series.items():
        reps = [by_path[p] for p in paths if p in by_path]
        for rid in dict.fromkeys(r for p in paths for r in (plan.decode[p].rids or [])):
            rows.append(_row(plan, rid, layer, rank, reps, series, entries, region_of))
    fault, sentence = overall(rows, [c.message for _, _, c in regions if c.is_finding])
    return DisaggReport(rows, fault, sentence, [], [], regions=regions, invalid=invalid, notes=plan.notes,
                        replays=replays, diffs=diffs)  # fmt: skip


def _row(plan, rid, layer, rank, reps, series, entries, region_of) -> Row:
    first = plan.first_capture.get((rid, layer, rank))
    holders = plan.prefill_of.get((rid, layer, rank), [])
    entry = entries.get((rid, first))
    if isinstance(entry, tuple):
        tcell = transfer_cell(entry[0])
        tcell.source_rid = entry[1]
    else:
        tcell = transfer_cell(None, entry or "")
    mine = [r for r in reps if request_index(r, rid) is not None]
    checks = [(p, region_of[p]) for p in [r.capture for r in mine] + holders if p in region_of]
    row = Row(rid, layer, rank, tcell, metadata_cell(rid, mine, series, checks), decode_cell(rid, mine),
              decode_captures=[r.capture for r in mine], prefill_captures=list(holders))  # fmt: skip
    row.fault, row.sentence = classify(row)
    return row
