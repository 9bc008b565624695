"""The disagg report as text: the capture counts, the region checks that are not ok, one table row per
(request, layer, rank), and the overall sentence."""

from __future__ import annotations

from refmla.disagg.report import DisaggReport, Row
from refmla.render.table import clip, table
from refmla.util import printable

HEADER = ["request", "layer", "rank", "transfer", "metadata", "decode", "diagnosis", "fault"]
MAX_ROWS = 400  # table rows printed (the JSON has all)


def render_disagg(report: DisaggReport) -> str:
    lines = [f"prefill  {len(report.prefill)} path(s), decode {len(report.decode)} path(s): "
             f"{len(report.replays)} decode capture(s) replayed, {len(report.diffs)} diff-kv run(s)"]  # fmt: skip
    lines += [printable(f"note     {n}") for n in report.notes]
    lines += [printable(f"invalid  {e if str(e).startswith(p) else f'{p}: {e}'}") for p, e in report.invalid]
    distinct: dict[tuple[str, str], list[str]] = {}  # one line per distinct region, its captures counted
    for side, path, check in report.regions:
        if check.status in ("finding", "warning"):
            distinct.setdefault((check.status, check.message), []).append(f"{side} {path}")
    for (status, message), where in distinct.items():
        more = f" and {len(where) - 1} more capture(s)" if len(where) > 1 else ""
        lines.append(printable(f"region   {status.upper()} ({where[0]}{more}): {message}"))
    unrecorded = sum(c.status == "not_recorded" for _, _, c in report.regions)
    if unrecorded:
        lines.append(f"region   not recorded in {unrecorded} capture(s): the MR region size was not checked there")
    shown = sorted(report.rows, key=lambda r: r.fault == "none")[:MAX_ROWS]
    lines += ["", table([_row(r) for r in shown], HEADER)]
    if len(report.rows) > MAX_ROWS:
        lines.append(f"... {len(report.rows) - MAX_ROWS} more rows (all in --json)")
    faults = [r for r in report.rows if r.fault != "none"]
    if faults:
        lines += ["", "faults:"] + [printable(f"  {r.sentence}") for r in faults[:32]]
    lines += ["", f"verdict  {report.sentence}"]
    return "\n".join(lines)


def _row(r: Row) -> list[str]:
    t = r.transfer
    if t.status == "faithful":
        transfer = f"faithful ({t.positions_compared})"
    elif t.status == "mismatch":
        transfer = f"MISMATCH {t.mismatched_positions} first pos {t.first_mismatch} page {t.first_page}"
        if t.cache is not None:  # a sparse pair: the cache it is in
            transfer = f"{t.cache}: {transfer}"
        if t.run is not None:
            transfer += f" run [{t.run['start']},{t.run['end']})"
            if t.run.get("offset") is not None:
                transfer += f" shift {t.run['offset']:+d}"
    else:
        transfer = t.status.replace("_", " ")
    md = r.metadata
    metadata = "ok" if md.ok else ", ".join(md.checks())
    if md.region is not None and md.region.status in ("finding", "warning"):
        metadata += f" | region {md.region.status}"
    d = r.decode
    decode = d.verdict if d.verdict != "diverged" else f"DIVERGED step {d.step} ({d.diverged_steps}/{d.steps})"
    failing = [n for n, s in d.backends.items() if s == "fail"]
    others = [n for n in failing if n != "observed"]
    who = ", ".join(failing) if others else "production only" if failing else ""
    diagnosis = "-" if d.diagnosis is None else f"{d.diagnosis}: {who}" if who else d.diagnosis
    return [r.rid, str(r.layer), str(r.rank), clip(transfer, 60), clip(metadata, 40), decode, clip(diagnosis, 40),
            r.fault if r.fault == "none" else r.fault.upper()]  # fmt: skip
