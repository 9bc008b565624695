"""The diff-kv result as text: a table of the requests, the transfer runs holding mismatches, a verdict."""

from __future__ import annotations

from refmla.diffkv.result import DiffResult, RequestDiff
from refmla.render.table import table
from refmla.util import printable

MAX_RUN_LINES = 32  # transfer runs listed under the table
HEADER = ["request", "compared", "mismatched", "first", "pages", "max_abs_diff", "norms p/d @first", "note"]


def render_diff(result: DiffResult) -> str:
    """The diff-kv result as a table, the transfer runs holding mismatches, and a verdict line."""
    sparse = result.caches is not None  # a sparse pair: one row per request and cache
    rows = [_row(e)[:1] + [_cache(result, e)] + _row(e)[1:] if sparse else _row(e) for e in result.requests]
    body = table(rows, HEADER[:1] + ["cache"] + HEADER[1:] if sparse else HEADER)
    return "\n".join([*_head(result), "", body, *_runs(result), *_sources(result), *_reuse(result), "", *_verdict(result)])


def _head(result: DiffResult) -> list[str]:
    pre = result.prefill
    kind = "capture(s)" if result.pairing == "tokens" else "chunk capture(s)"
    chunks = f" (+{len(pre) - 1} {kind}: {', '.join(pre[1:])})" if len(pre) > 1 else ""
    lines = [
        f"prefill  {pre[0]}{chunks}",
        f"decode   {result.decode}",
        f"paired by {result.pairing}, pages of {result.page_size} (decode side), compared {result.compared}"
        if result.caches is None else f"paired by {result.pairing}, compared {result.compared} (packed tokens), caches: "
        + ", ".join(f"{c['label']} ({c['layout']}, pages of {c['page_size']})" for c in result.caches.values()),
        *(f"note     {n}" for n in result.notes),
    ]
    return [printable(line) for line in lines]


def _cache(result: DiffResult, e: RequestDiff) -> str:
    return (result.caches or {}).get(e.cache, {}).get("label", e.cache or "-")


def _row(e: RequestDiff) -> list[str]:
    note = e.summary or e.note or ("" if e.status == "match" else e.status)
    dis = e.prefill_disagreements
    if dis is not None and dis.positions:
        who = "captures holding these tokens" if e.reuse is not None else "prefill chunks"
        note += f" | {who} disagree at {dis.positions} positions (first {dis.first})"
    mm = e.mismatches
    return [
        str(e.request),
        str(e.positions_compared),
        str(e.mismatched_positions),
        "-" if e.first_mismatch is None else str(e.first_mismatch),
        _pages_text(e.mismatched_pages),
        f"{mm.max_abs_diff:.3g}" if mm is not None else "-",
        f"{mm.first.prefill_norm:.4g} / {mm.first.decode_norm:.4g}" if mm is not None else "-",
        note,
    ]


def _runs(result: DiffResult) -> list[str]:
    runs = [(f"{e.request} {_cache(result, e)}" if e.cache else e.request, run) for e in result.requests
            if e.transfer_runs is not None for run in e.transfer_runs.mismatched]  # fmt: skip
    if not runs:
        return []
    lines = ["", "transfer runs (contiguous on both sides) holding mismatches:"]
    for req, run in runs[:MAX_RUN_LINES]:
        extra = ""
        if run.offset is not None:
            extra = f", decode rows are the prefill rows shifted by {run.offset}"
        elif run.decode_zero_rows:
            extra = f", {run.decode_zero_rows} decode rows all zero"
        lines.append(
            f"  {req}: positions [{run.start}, {run.end}) pages {run.pages[0]}-{run.pages[1]} "
            f"prefill slot {run.prefill_slot} -> decode slot {run.decode_slot}: "
            f"{run.mismatched_positions} of {run.positions} mismatched{extra}"
        )
    if len(runs) > MAX_RUN_LINES:
        lines.append(f"  ... {len(runs) - MAX_RUN_LINES} more")
    return lines


def _sources(result: DiffResult) -> list[str]:
    """Where the mismatched rows' bytes are in the prefill captures (refmla.diffkv.provenance)."""
    said = [f"  {e.request}{' ' + _cache(result, e) if e.cache else ''}: {src.text(e.rid)}" for e in result.requests
            for src in (e.sources or [])]  # fmt: skip
    return ["", "mismatched rows found in the prefill:", *said[:MAX_RUN_LINES]] if said else []


def _reuse(result: DiffResult) -> list[str]:
    """Paired by tokens: whose rows each request was compared with, and its positions with no counterpart."""
    lines = []
    for e in result.requests:
        if e.reuse is None:
            continue
        parts = [f"{_spans(w.ranges)} against {w.rid if w.rid is not None else 'a request'} (capture {w.capture})"
                 for w in e.reuse.written_by]  # fmt: skip
        if e.reuse.unmatched:
            parts.append(f"{_spans(e.reuse.unmatched)} no counterpart (not compared)")
        origins = ", ".join(f"{n} {k}" for k, n in e.reuse.origins.items())
        lines.append(f"  {e.request}: " + "; ".join(parts) + (f" | compared rows by origin: {origins}" if origins else ""))
    return ["", "rows compared by the tokens they hold:", *lines[:MAX_RUN_LINES]] if lines else []


def _spans(runs: list) -> str:
    return "positions " + ", ".join(f"{a}-{b - 1}" if b - a > 1 else str(a) for a, b in runs[:4]) + (" ..." if len(runs) > 4 else "")


def _verdict(result: DiffResult) -> list[str]:
    if result.error is not None:
        lines = [f"verdict  NOTHING COMPARED: {result.error}"]
    elif result.ok:
        lines = [f"verdict  match: {result.positions_compared} positions of {result.paired_requests} "
                 "request(s) identical"]  # fmt: skip
    else:
        lines = [f"verdict  MISMATCH: {result.mismatched_positions} of {result.positions_compared} positions "
                 f"in {result.mismatched_requests} of {result.paired_requests} request(s)"]  # fmt: skip
    if result.prefill_only or result.decode_only:
        lines.append(f"unpaired {len(result.prefill_only)} request(s) only on the prefill side, "
                     f"{len(result.decode_only)} only on the decode side")  # fmt: skip
    return lines


def _pages_text(pages: list[int], limit: int = 8) -> str:
    """Sorted pages as "3,5-9,12", at most ``limit`` runs."""
    if not pages:
        return "-"
    runs: list[list[int]] = []  # [first, last] of consecutive pages
    for p in pages:
        if runs and p == runs[-1][1] + 1:
            runs[-1][1] = p
        else:
            runs.append([p, p])
    parts = [f"{a}" if a == b else f"{a}-{b}" for a, b in runs]
    return ",".join(parts[:limit]) + (f",... ({len(pages)} pages)" if len(parts) > limit else "")
