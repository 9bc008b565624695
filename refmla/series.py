"""Many captures at once: series checks across decode steps, parallel replay, the summary table.

A *series* is the captures of one layer on one rank, ordered by ``meta.step`` (file order when
a capture has no step). Between consecutive captures, each request (paired by rid, else by
order) must

    grow by exactly one token per decode step    seq_len[t+1] == seq_len[t] + (step[t+1] - step[t])
                                                  (an extend capture: + its new tokens)
    keep its earlier rows                         the KV rows at positions < seq_len[t] are the
                                                  same bytes in both captures

Findings are attached to the later capture's report under ``"series"``, so ``--json`` stays a
plain array of report objects.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from typing import Optional, Sequence

import torch

from refmla.capture import Capture, CaptureError, read_capture
from refmla.pool import rows_differ
from refmla.util import first_line, request_label, single_thread

MAX_LINES = 20  # series findings listed under the summary table

# --------------------------------------------------------------------------------------------
# Series checks
# --------------------------------------------------------------------------------------------


def _header(path: str) -> Optional[dict]:
    """The capture's meta from the safetensors header alone (no tensor is read); None if unreadable."""
    try:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt", device="cpu") as f:
            return json.loads((f.metadata() or {})["meta"])
    except Exception:
        return None


def group_series(paths: Sequence[str]) -> dict[tuple, list[str]]:
    """(layer_id, tp_rank) -> paths in step order (file order where a capture lacks a step).

    Unreadable files are left out (the replay reports them).
    """
    groups: dict[tuple, list[tuple]] = {}
    for order, p in enumerate(paths):
        meta = _header(p)
        if meta is None:
            continue
        key = (meta.get("layer_id"), meta.get("tp_rank"))
        groups.setdefault(key, []).append((meta.get("step"), order, p))
    out = {}
    for key, items in groups.items():
        if all(isinstance(s, int) for s, _, _ in items):
            items.sort(key=lambda t: (t[0], t[1]))
        out[key] = [p for _, _, p in items]
    return out


def series_checks(paths: Sequence[str]) -> dict[str, list[dict]]:
    """path -> series findings of that capture (against the previous capture of its series).

    Every readable path gets an entry (an empty list when nothing was found). Holds at most two
    captures in memory at a time.
    """
    found: dict[str, list[dict]] = {}
    for group in group_series(paths).values():
        prev: Optional[Capture] = None
        for p in group:
            try:
                cap = read_capture(p)
            except CaptureError:
                continue  # reported as invalid by the replay; the series goes on without it
            with single_thread():
                found[p] = [] if prev is None else compare_steps(prev, cap)
            prev = cap
    return found


def attach_series(reports: list[dict]) -> None:
    """Add ``report["series"]`` (a list of findings) to every readable capture's report."""
    found = series_checks([r["capture"] for r in reports])  # unreadable files are skipped there
    for r in reports:
        if r["capture"] in found:
            r["series"] = found[r["capture"]]


def pair_steps(prev: Capture, nxt: Capture) -> tuple[str, list[tuple[int, int]]]:
    """("rid" | "order", [(request in prev, request in nxt)])."""
    if prev.meta.rids is not None and nxt.meta.rids is not None:
        where = {}
        for b, rid in enumerate(prev.meta.rids[: prev.batch_size]):
            where.setdefault(rid, b)
        return "rid", [(where[rid], b) for b, rid in enumerate(nxt.meta.rids[: nxt.batch_size]) if rid in where]
    return "order", [(b, b) for b in range(min(prev.batch_size, nxt.batch_size))]


def compare_steps(prev: Capture, nxt: Capture) -> list[dict]:
    """Findings for ``nxt`` against the previous capture of its series."""
    findings: list[dict] = []
    s0, s1 = prev.meta.step, nxt.meta.step
    dstep = s1 - s0 if s0 is not None and s1 is not None else 1
    base = {"previous": prev.path, "step": s1, "previous_step": s0}
    if dstep <= 0:
        return [{**base, "check": "series_step", "severity": "note", "request": None, "rid": None,
                 "message": f"step {s1} follows step {s0} ({prev.path}); not compared"}]  # fmt: skip
    how, pairs = pair_steps(prev, nxt)
    if how == "order" and prev.batch_size != nxt.batch_size:
        findings.append({**base, "check": "series_pairing", "severity": "note", "request": None, "rid": None,
                         "message": f"no rids: requests paired by order, but the batch has {prev.batch_size} then "
                                    f"{nxt.batch_size} requests"})  # fmt: skip
    pp, pn = prev.kv_indptr.long(), nxt.kv_indptr.long()
    rows_p, rows_n, owner = [], [], []
    for bp, bn in pairs:
        L0, L1 = int(prev.seq_lens[bp]), int(nxt.seq_lens[bn])
        grow = dstep if nxt.is_decode else int(nxt.qo_indptr[bn + 1] - nxt.qo_indptr[bn])
        rid = nxt.rid(bn)
        who = request_label(bn, rid)
        if L1 - L0 != grow:
            findings.append({**base, "check": "seq_len_step", "severity": "warning", "request": bn, "rid": rid,
                             "previous_request": bp, "seq_len": L1, "previous_seq_len": L0, "delta": L1 - L0,
                             "expected_delta": grow,
                             "message": f"{who}: seq_len {L0} at step {s0} -> {L1} at step {s1} "
                                        f"({L1 - L0:+d}, expected {grow:+d})"})  # fmt: skip
        n = min(L0, L1)
        rows_p.append(prev.kv_indices.long()[int(pp[bp]) : int(pp[bp]) + n])
        rows_n.append(nxt.kv_indices.long()[int(pn[bn]) : int(pn[bn]) + n])
        owner.append(n)
    if not pairs:
        return findings
    rp, rn = torch.cat(rows_p), torch.cat(rows_n)
    changed = (
        rows_differ(prev.kv_buffer, rp, nxt.kv_buffer, rn)
        if prev.kv_buffer.shape[-1] == nxt.kv_buffer.shape[-1]
        else None
    )
    if changed is None:
        return findings
    off = 0
    for (bp, bn), n in zip(pairs, owner):
        c = changed[off : off + n]
        off += n
        if not bool(c.any()):
            continue
        pos = torch.nonzero(c).flatten()
        rid = nxt.rid(bn)
        who = request_label(bn, rid)
        P = nxt.meta.page_size
        findings.append({**base, "check": "kv_rows_changed", "severity": "warning", "request": bn, "rid": rid,
                         "previous_request": bp, "count": int(pos.numel()), "first_position": int(pos[0]),
                         "pages": torch.unique(pos // P).tolist()[:64],
                         "message": f"{who}: {int(pos.numel())} of {n} earlier positions hold other KV bytes than at "
                                    f"step {s0}, first position {int(pos[0])}"})  # fmt: skip
    return findings


# --------------------------------------------------------------------------------------------
# Parallel replay
# --------------------------------------------------------------------------------------------


def _init_worker(threads: int) -> None:
    """Runs first in every worker process: choose the Triton interpreter before triton is imported."""
    try:
        from refmla.backends.triton_interp import ensure_interpreter
    except ImportError:
        pass
    else:
        ensure_interpreter()
    torch.set_num_threads(max(1, threads))


def replay_one(path: str, opts) -> dict:
    """replay_file that never raises: a crash of refmla itself becomes an ``invalid`` report."""
    from refmla.replay import invalid_report, replay_file

    try:
        return replay_file(path, opts)
    except Exception as e:  # one bad file must not end the run
        msg = first_line(e)
        return invalid_report(str(path), CaptureError(path, "replay", f"{type(e).__name__}: {msg}"))


def replay_parallel(paths: Sequence[str], opts, jobs: int) -> list[dict]:
    """Replay every capture in ``jobs`` worker processes; reports in the order of ``paths``.

    Workers are spawned (not forked), so each selects the Triton interpreter before importing
    triton. A file that makes its worker die is replayed once more alone; if that dies too it is
    reported ``invalid``. Progress goes to stderr.
    """
    from refmla.report import Progress

    paths = [str(p) for p in paths]
    reports: list[Optional[dict]] = [None] * len(paths)
    progress = Progress(len(paths))
    threads = max(1, (os.cpu_count() or 1) // max(1, jobs))
    died = _run_pool(paths, list(range(len(paths))), opts, jobs, threads, reports, progress)
    for i in died:  # the pool broke: whoever was running, plus everyone queued behind
        again = _run_pool(paths, [i], opts, 1, threads, reports, progress)
        if again:
            err = CaptureError(paths[i], "replay", "the worker process died replaying this capture")
            from refmla.replay import invalid_report

            reports[i] = invalid_report(paths[i], err)
            progress.step(paths[i])
    progress.close()
    return reports  # type: ignore[return-value]


def _run_pool(paths, todo, opts, jobs, threads, reports, progress) -> list[int]:
    """Run ``todo`` in one pool; returns the indices whose future failed with a broken pool."""
    import multiprocessing as mp

    died = []
    with ProcessPoolExecutor(max_workers=min(jobs, len(todo)), mp_context=mp.get_context("spawn"),
                             initializer=_init_worker, initargs=(threads,)) as pool:  # fmt: skip
        futs = {pool.submit(replay_one, paths[i], opts): i for i in todo}
        for fut in as_completed(futs):
            i = futs[fut]
            try:
                reports[i] = fut.result()
            except BrokenProcessPool:
                died.append(i)
                continue
            progress.step(paths[i])
    return sorted(died)


# --------------------------------------------------------------------------------------------
# Summary table
# --------------------------------------------------------------------------------------------


def _key(r: dict) -> tuple:
    m = r.get("meta") or {}
    return (m.get("layer_id"), m.get("tp_rank"), m.get("step"))


def _sort_key(k: tuple) -> tuple:
    return tuple((v is None, v if v is not None else 0) for v in k)


def summary_table(reports: list[dict]) -> str:
    """One row per (layer, rank, step): verdict counts, diagnoses, the worst failing backend,
    series findings; then a totals line and the invalid captures."""
    from refmla.report import table

    groups: dict[tuple, list[dict]] = {}
    invalid = []
    for r in reports:
        if r.get("verdict") == "invalid" and not r.get("meta"):
            invalid.append(r)
            continue
        groups.setdefault(_key(r), []).append(r)
    rows = []
    for key in sorted(groups, key=_sort_key):
        rs = groups[key]
        n = {v: sum(1 for r in rs if r.get("verdict") == v) for v in ("agree", "diverged", "invalid")}
        diag = sorted({str(r.get("diagnosis")) for r in rs if r.get("diagnosis")})
        worst_name, worst_err = None, None
        for r in rs:
            for name, b in (r.get("backends") or {}).items():
                e = b.get("max_abs_err")
                if b.get("status") == "fail" and e is not None and (worst_err is None or e > worst_err):
                    worst_name, worst_err = name, e
        series = sum(1 for r in rs for f in r.get("series") or [] if f.get("severity") == "warning")
        warn = sum(len((r.get("metadata") or {}).get("warnings") or []) for r in rs)
        rows.append([
            *("-" if v is None else str(v) for v in key), str(len(rs)), str(n["agree"]),
            str(n["diverged"]) if not n["diverged"] else f"{n['diverged']} !", str(n["invalid"]),
            ",".join(diag) or "-", f"{worst_name} {worst_err:.3g}" if worst_name else "-",
            str(warn) if warn else "-", str(series) if series else "-",
        ])  # fmt: skip
    header = ["layer", "rank", "step", "captures", "agree", "diverged", "invalid", "diagnosis", "worst failing",
              "metadata warnings", "series findings"]  # fmt: skip
    count = {v: sum(1 for r in reports if r.get("verdict") == v) for v in ("agree", "diverged", "invalid")}
    series_total = sum(1 for r in reports for f in r.get("series") or [] if f.get("severity") == "warning")
    totals = (f"{len(reports)} captures: {count['agree']} agree, {count['diverged']} diverged, "
              f"{count['invalid']} invalid; {series_total} series finding(s)")  # fmt: skip
    lines = ["summary by layer, rank and step", table(rows, header) if rows else "(no readable capture)", "", totals]
    shown = [
        (r["capture"], f["message"]) for r in reports for f in r.get("series") or [] if f.get("severity") == "warning"
    ]
    lines += [f"  series {p}: {m}" for p, m in shown[:MAX_LINES]]
    if len(shown) > MAX_LINES:
        lines.append(f"  ... {len(shown) - MAX_LINES} more series finding(s) (see --json)")
    for r in invalid:
        why = r.get("error") or "; ".join(r["metadata"]["errors"])
        lines.append(f"  invalid {why if why.startswith(r['capture']) else r['capture'] + ': ' + why}")
    return "\n".join(lines)
