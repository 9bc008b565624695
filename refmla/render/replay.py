"""A replay report as text: the header lines, the backend table, the verdict; and the summary of many."""

from __future__ import annotations

from typing import Optional

from refmla.blame import worst_blame
from refmla.render.table import clip, fmt, table
from refmla.nextsteps import text_lines
from refmla.results import BackendEntry, ReplayReport, alternatives_text
from refmla.series import no_series_note
from refmla.util import printable

MAX_WARNINGS = 8  # metadata warnings printed under one report
MAX_SERIES_LINES = 20  # series findings listed under the summary table
VERDICTS = ("agree", "diverged", "invalid")


def render(report: ReplayReport) -> str:
    """One capture's report as a table plus the verdict and diagnosis lines."""
    lines = [f"capture  {printable(report.capture)}"]
    if report.verdict == "invalid" and not report.backends:
        lines.append(f"verdict  invalid: {printable(report.error or '; '.join(report.metadata.errors))}")
        return "\n".join(lines)
    lines.append(shape_line(report))
    md = report.metadata
    lines.append("metadata " + ("ok" if md.ok else "INVALID") + (f", {len(md.warnings)} warning(s)" if md.warnings else ""))
    lines += [f"  warning: {printable(w)}" for w in md.warnings[:MAX_WARNINGS]]
    lines += [f"  error: {printable(e)}" for e in md.errors]
    if report.control is not None:
        c, t = report.control, report.tolerance
        lines.append(f"noise    control ({c.dtype} rounding points) max abs err {fmt(c.max_abs_err)}, "
                     f"tolerance k={t.k} ulps={t.ulps} cos={t.cos}")  # fmt: skip
    rows = [backend_row(name, b) for name, b in report.backends.items()]
    lines += ["", table(rows, ["backend", "status", "max_abs_err", "cos_diff", "worst", "note"]), ""]
    lines.append(f"verdict  {report.verdict}")
    if report.diagnosis is not None or report.verdict != "agree":
        lines.append(f"diagnosis {report.diagnosis}: {report.diagnosis_text}")
    else:
        lines.append(f"diagnosis {report.diagnosis_text}")
    for name, b in report.backends.items():
        if b.status == "fail" and b.explanation is not None:
            lines.append(f"  {name}: {b.explanation.text()}")
    lines += text_lines(report.next_steps or [])
    if report.verify_vs_decode:
        lines += ["", "verify vs plain decode over the same KV", verify_paths_table(report.verify_vs_decode, report.backends)]
    return "\n".join(lines)


def render_or_say(report: ReplayReport) -> str:
    """:func:`render`, or when rendering itself fails, the capture, its verdict and why: one report's
    text never costs the others'."""
    try:
        return render(report)
    except Exception as e:
        return (f"capture  {printable(report.capture)}\nverdict  {report.verdict}  (the report could not be rendered: "
                f"{printable(type(e).__name__)}; see --json)")


def verify_paths_table(rows: list[dict], backends: Optional[dict] = None) -> str:
    """The verify capture's paths over the same KV (refmla.diagnosis.verify_table), one line each;
    with the report's ``backends``, a misplaced NaN / Inf reads as such (BackendEntry.err_text)."""
    backends = backends or {}
    body = [[r["path"], r["backend"], r["status"].upper() if r["status"] == "fail" else r["status"],
             backends[r["backend"]].err_text() if r["backend"] in backends else
             fmt(r["max_abs_err"]) if r["max_abs_err"] is not None else "-",
             (r["reason"] or "")[:70] if r["status"] != "pass" else ""] for r in rows]  # fmt: skip
    return table(body, ["path", "backend", "status", "max_abs_err", "note"])


def shape_line(report: ReplayReport) -> str:
    s, m = report.shape, report.meta
    if m is not None and hasattr(m, "summary") and not hasattr(m, "backend"):  # a kind of its own (kv_write, merge, ...)
        dims = "" if s is None else (f"  requests={s.requests} rows={s.rows} heads={s.heads} D={s.head_dim} Dv={s.v_head_dim}"
                                     + "".join(f" {k}={v}" for k, v in s.dims.items()))  # fmt: skip
        return printable(f"kind     {report.mode}  {m.summary()}{dims}")
    where = "".join(f"  {word} {value}" for word, value in (("layer", m.layer_id), ("rank", m.tp_rank), ("step", m.step))
                    if value is not None) if m else ""  # fmt: skip
    path = m.extra.get("aiter_path") if m else None
    where = printable(where)
    return (f"shape    {report.mode}  requests={s.requests} heads={s.heads} D={s.head_dim} Dv={s.v_head_dim} "
            f"q={s.q_dtype} kv={s.kv_dtype} max_seq_len={s.max_seq_len}  produced by {printable(m.backend if m else None)}"
            f"{' (' + printable(path) + ' kernel)' if path else ''}{where}")  # fmt: skip


def backend_row(name: str, b: BackendEntry) -> list[str]:
    w, blame = b.worst, worst_blame(b)
    named = w is not None and w.request is not None
    where = blame.text() if blame else (f"req {w.request} head {w.head}" if named else "-")
    note = b.reason or ""
    if b.status == "pass":
        info = b.info or {}
        mask = f"custom_mask {info['custom_mask']}; " if info.get("custom_mask") else ""  # verify: Triton extend
        path = f"{info['path']} path; " if info.get("path") else ""
        note = clip(mask + path + (info.get("version") or ""), 70)
    if b.explanation is not None:
        note = b.explanation.text()
        if b.explanation.other_causes:  # another hypothesis gives the same output within noise
            note += "; or " + alternatives_text({}, b.explanation.other_causes)
    if b.localization is not None and (b.explanation is None or not b.explanation.complete):
        # the table's where for a failure nothing (or not all) explains; an explanation names its own
        # positions, and the localization stays in the JSON beside it
        note += (" | " if note else "") + b.localization.text()
    if b.splits is not None and b.splits.status in ("pass", "fail"):
        note += f" | splits {b.splits.status} ({b.splits.compared_splits} partials)"
    status = b.status.upper() if b.status == "fail" else b.status
    return [name, status, b.err_text(), fmt(b.cos_diff), where, note]


# --------------------------------------------------------------------------------------------
# Many reports
# --------------------------------------------------------------------------------------------


def _sort_key(k: tuple) -> tuple:
    return tuple((v is None, v if v is not None else 0) for v in k)


def _warnings(findings) -> list:
    return [f for f in findings or [] if f.severity == "warning"]


def summary_table(reports: list[ReplayReport]) -> str:
    """One row per (layer, rank, step): verdict counts, diagnoses, the worst failing backend,
    series findings; then a totals line and the invalid captures."""
    groups: dict[tuple, list[ReplayReport]] = {}
    invalid = []
    for r in reports:
        if r.verdict == "invalid" and not r.meta:
            invalid.append(r)
        else:
            groups.setdefault(r.key(), []).append(r)
    rows = [summary_row(key, groups[key]) for key in sorted(groups, key=_sort_key)]
    header = ["layer", "rank", "step", "captures", "agree", "diverged", "invalid", "diagnosis", "worst failing",
              "metadata warnings", "series findings"]  # fmt: skip
    count = {v: sum(1 for r in reports if r.verdict == v) for v in VERDICTS}
    shown = [(r.capture, f.message) for r in reports for f in _warnings(r.series)]
    totals = (f"{len(reports)} captures: {count['agree']} agree, {count['diverged']} diverged, "
              f"{count['invalid']} invalid; {len(shown)} series finding(s)")  # fmt: skip
    lines = ["summary by layer, rank and step", table(rows, header) if rows else "(no readable capture)", "", totals]
    note = no_series_note(sum(r.meta is not None and r.series is None for r in reports), len(reports))
    lines += [note] if note else []
    lines += [printable(f"  series {p}: {m}") for p, m in shown[:MAX_SERIES_LINES]]
    if len(shown) > MAX_SERIES_LINES:
        lines.append(f"  ... {len(shown) - MAX_SERIES_LINES} more series finding(s) (see --json)")
    for r in invalid:
        why = r.error or "; ".join(r.metadata.errors)
        why = why if why.startswith(printable(r.capture)) else f"{r.capture}: {why}"
        lines.append(f"  invalid {printable(why)}")
    return "\n".join(lines)


def summary_row(key: tuple, rs: list[ReplayReport]) -> list[str]:
    n = {v: sum(1 for r in rs if r.verdict == v) for v in VERDICTS}
    diag = sorted({str(r.diagnosis) for r in rs if r.diagnosis})
    failing = [(b.badness(), name, b) for r in rs for name, b in r.backends.items()
               if b.status == "fail" and b.max_abs_err is not None]  # fmt: skip
    worst = max(failing, default=None, key=lambda t: t[0])
    series = sum(len(_warnings(r.series)) for r in rs)
    warn = sum(len(r.metadata.warnings) for r in rs)
    return [
        *("-" if v is None else str(v) for v in key), str(len(rs)), str(n["agree"]),
        str(n["diverged"]) if not n["diverged"] else f"{n['diverged']} !", str(n["invalid"]),
        ",".join(diag) or "-", f"{worst[1]} {worst[2].err_text()}" if worst else "-",
        str(warn) if warn else "-", str(series) if series else "-",
    ]  # fmt: skip
