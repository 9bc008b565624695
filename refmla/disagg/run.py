"""``refmla disagg``: the existing checks over a prefill node's and a decode node's captures, in order:

    writers   the prefill node's KV writer captures (mode kv_write) among the prefill paths, judged
              (refmla.disagg.writer): the first link, written -> transferred -> read
    indexers  the indexer captures (mode indexer) of either side: judged by the sparse decode replay
              beside them, or alone (refmla.disagg.indexers); never read as KV captures
    plan      headers only: decode series by (layer, rank), each request's first decode capture
              and the prefill captures holding its rid (refmla.disagg.plan)
    replay    every decode capture through every backend (refmla.batch.replay_many, ``jobs``
              worker processes); each report carries its metadata checks (refmla.checks)
    diff-kv   in the same worker right after (refmla.disagg.task): each request's first decode
              capture against its prefill captures (refmla.diffkv.diff_kv)
    series    the decode captures of one (layer, rank) across steps (refmla.series.series_checks)
    regions   the MR region-size check of every capture's pool geometry (refmla.region_check)
    rows      one per (request, layer, rank), classified (refmla.disagg.classify)
"""

from __future__ import annotations

import time
from functools import partial
from typing import Sequence

from refmla.batch import replay_many
from refmla.context import ReplayOptions
from refmla.diffkv import DiffResult
from refmla.disagg.cells import decode_cell, metadata_cell, request_index, transfer_cell
from refmla.disagg.classify import classify, overall
from refmla.disagg.indexers import Indexers, judge_indexers, split_indexers
from refmla.disagg.plan import DisaggPlan, plan_disagg
from refmla.disagg.task import DecodeDone, decode_task
from refmla.disagg.writer import judge_writers, split_writers, writer_cell
from refmla.disagg.report import DisaggReport, Row
from refmla.results import ReplayReport
from refmla.series import series_checks


def run_disagg(prefill_paths: Sequence[str], decode_paths: Sequence[str], opts: ReplayOptions,
               jobs: int = 1) -> DisaggReport:  # fmt: skip
    """The whole disaggregated check (module docstring); never raises for one bad capture. Options out
    of their bounds (refmla.options) are a ValueError before any work."""
    opts.check()
    t0 = time.perf_counter()
    writers, prefill_caps = split_writers([str(p) for p in prefill_paths])
    found_p, prefill_caps = split_indexers(prefill_caps)
    found_d, decode_caps = split_indexers([str(p) for p in decode_paths])
    plan = plan_disagg(prefill_caps, decode_caps)
    plan.writers = judge_writers(writers, opts)
    indexers = judge_indexers(found_p + found_d, list(plan.decode.values()), opts)
    decode = [p for p in decode_paths if p in plan.decode]
    t1 = time.perf_counter()
    by_decode = {j.decode: j for j in plan.jobs}
    done = [d if isinstance(d, DecodeDone) else DecodeDone(d)  # a worker that died: an invalid report
            for d in replay_many(decode, opts, jobs=jobs, task=partial(decode_task, jobs=by_decode))]  # fmt: skip
    t2 = time.perf_counter()
    series = series_checks(decode) if len(decode) > 1 else {}
    t3 = time.perf_counter()
    entries = {(rid, d.report.capture): e for d in done for rid, e in d.entries.items()}
    for d in done:
        if d.error is not None and d.error not in plan.invalid:
            plan.invalid.append(d.error)
    report = _assemble(plan, [d.report for d in done], series, [d.diff for d in done if d.diff], entries)
    _with_indexers(report, indexers)
    report.prefill, report.decode = list(prefill_paths), list(decode_paths)
    seconds = {"plan": t1 - t0, "replay_and_diff_kv": t2 - t1, "series": t3 - t2, "total": time.perf_counter() - t0}
    report.seconds = {k: round(v, 3) for k, v in seconds.items()}
    return report


def _assemble(plan: DisaggPlan, replays: list[ReplayReport], series: dict, diffs: list[DiffResult],
              entries: dict) -> DisaggReport:  # fmt: skip
    by_path = {r.capture: r for r in replays}
    invalid = list(plan.invalid) + [(r.capture, r.error or "; ".join(r.metadata.errors))
                                    for r in [*replays, *plan.writers] if r.verdict == "invalid"]  # fmt: skip
    regions = [("prefill", p, h.region()) for p, h in plan.prefill.items()]
    regions += [("decode", p, h.region()) for p, h in plan.decode.items()]
    region_of = {p: c for _, p, c in regions}
    rows: list[Row] = []
    for (layer, rank), paths in plan.series.items():
        reps = [by_path[p] for p in paths if p in by_path]
        for rid in dict.fromkeys(r for p in paths for r in (plan.decode[p].rids or [])):
            rows.append(_row(plan, rid, layer, rank, reps, series, entries, region_of))
    fault, sentence = overall(rows, [c.message for _, _, c in regions if c.is_finding])
    return DisaggReport(rows, fault, sentence, [], [], regions=regions, invalid=invalid, notes=plan.notes,
                        replays=replays, diffs=diffs)  # fmt: skip


def _with_indexers(report: DisaggReport, found: Indexers) -> None:
    """The indexer captures judged alone: their reports and notes; an invalid one exits 2, a wrong
    set is a compute fault of the run (the indexer's), never a silent pass."""
    report.indexers = found.alone
    report.notes += found.notes()
    report.invalid += [(r.capture, r.error or "; ".join(r.metadata.errors)) for r in found.alone if r.verdict == "invalid"]
    bad = found.diverged()
    if not bad:
        return
    said = f"the indexer chose the wrong entries in {len(bad)} capture(s) judged alone, first {bad[0].capture}: {bad[0].diagnosis_text}"
    if report.fault == "none":
        report.fault, report.sentence = "compute", f"fault in the compute: {said}"
    else:
        report.sentence += f"; also {said}"


def _row(plan, rid, layer, rank, reps, series, entries, region_of) -> Row:
    first = plan.first_capture.get((rid, layer, rank))
    holders = plan.prefill_of.get((rid, layer, rank), [])
    entry = entries.get((rid, first))
    if isinstance(entry, tuple):
        tcell = transfer_cell(entry[0], caches=entry[2])
        tcell.source_rid = entry[1] or tcell.source_rid
    else:
        tcell = transfer_cell(None, entry or "")
    mine = [r for r in reps if request_index(r, rid) is not None]
    checks = [(p, region_of[p]) for p in [r.capture for r in mine] + holders if p in region_of]
    row = Row(rid, layer, rank, tcell, metadata_cell(rid, mine, series, checks), decode_cell(rid, mine),
              decode_captures=[r.capture for r in mine], prefill_captures=list(holders))  # fmt: skip
    if plan.writers:
        row.writer = writer_cell(rid, layer, plan.writers)
    row.fault, row.sentence = classify(row)
    return row
