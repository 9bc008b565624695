"""Human-readable rendering of replay reports (the JSON is the report; this only prints it)."""

from __future__ import annotations

import sys
from typing import Any, Optional, TextIO


def _fmt(x: Any) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return "0" if x == 0 else f"{x:.3g}"
    return str(x)


def table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    line = lambda r: "  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


def explanation_text(e: Optional[dict]) -> str:
    if not e:
        return ""
    detail = ", ".join(f"{k}={v}" for k, v in (e.get("detail") or {}).items())
    who = f" request {e['request']}" if e.get("request") is not None else ""
    return f"explained by {e['hypothesis']}({detail}){who}"


def render(report: dict) -> str:
    """One capture's report as a table plus the verdict and diagnosis lines."""
    lines = [f"capture  {report['capture']}"]
    if report["verdict"] == "invalid" and not report.get("backends"):
        lines.append(f"verdict  invalid: {report.get('error') or '; '.join(report['metadata']['errors'])}")
        return "\n".join(lines)
    s, m = report.get("shape", {}), report.get("meta", {})
    lines.append(
        f"shape    {report.get('mode')}  requests={s.get('requests')} heads={s.get('heads')} "
        f"D={s.get('head_dim')} Dv={s.get('v_head_dim')} q={s.get('q_dtype')} kv={s.get('kv_dtype')} "
        f"max_seq_len={s.get('max_seq_len')}  produced by {m.get('backend')}"
        + (f"  layer {m['layer_id']}" if m.get("layer_id") is not None else "")
        + (f"  rank {m['tp_rank']}" if m.get("tp_rank") is not None else "")
        + (f"  step {m['step']}" if m.get("step") is not None else "")
    )
    md = report["metadata"]
    lines.append("metadata " + ("ok" if md["ok"] else "INVALID") + (f", {len(md['warnings'])} warning(s)" if md["warnings"] else ""))
    for w in md["warnings"][:8]:
        lines.append(f"  warning: {w}")
    for e in md["errors"]:
        lines.append(f"  error: {e}")
    if report.get("control"):
        c = report["control"]
        lines.append(f"noise    control ({c['dtype']} rounding points) max abs err {_fmt(c['max_abs_err'])}, "
                     f"tolerance k={report['tolerance']['k']} ulps={report['tolerance']['ulps']} cos={report['tolerance']['cos']}")  # fmt: skip
    rows = []
    for name, b in report.get("backends", {}).items():
        worst = b.get("worst") or {}
        where = f"req {worst['request']} head {worst['head']}" if worst.get("request") is not None else "-"
        note = b.get("reason") or ""
        if b["status"] in ("pass",):
            note = _info_note(b)
        if b.get("explanation"):
            note = explanation_text(b["explanation"])
        if b.get("splits") and b["splits"].get("status") in ("pass", "fail"):
            sp = b["splits"]
            note += f" | splits {sp['status']} ({sp.get('compared_splits')} partials)"
        rows.append([name, b["status"].upper() if b["status"] == "fail" else b["status"],
                     _fmt(b.get("max_abs_err")), _fmt(b.get("cos_diff")), where, note])  # fmt: skip
    lines += ["", table(rows, ["backend", "status", "max_abs_err", "cos_diff", "worst", "note"]), ""]
    lines.append(f"verdict  {report['verdict']}")
    if report.get("diagnosis") is not None or report["verdict"] != "agree":
        lines.append(f"diagnosis {report.get('diagnosis')}: {report.get('diagnosis_text', '')}")
    else:
        lines.append(f"diagnosis {report.get('diagnosis_text', '')}")
    for name, b in report.get("backends", {}).items():
        if b.get("status") == "fail" and b.get("explanation"):
            lines.append(f"  {name}: {explanation_text(b['explanation'])}")
    return "\n".join(lines)


def _info_note(b: dict) -> str:
    info = b.get("info") or {}
    v = info.get("version") or ""
    return v if len(v) < 70 else v[:67] + "..."


class Progress:
    """A one-line progress bar on stderr (only when stderr is a terminal)."""

    def __init__(self, total: int, stream: Optional[TextIO] = None):
        self.total, self.done, self.stream = total, 0, stream or sys.stderr
        self.live = total > 1 and hasattr(stream, "isatty") and stream.isatty()

    def step(self, label: str) -> None:
        self.done += 1
        if self.live:
            bar = "#" * (20 * self.done // self.total)
            self.stream.write(f"\r[{bar:<20}] {self.done}/{self.total} {label[-50:]:<50}")
            self.stream.flush()
        elif self.total > 1:
            self.stream.write(f"[{self.done}/{self.total}] {label}\n")

    def close(self) -> None:
        if self.live:
            self.stream.write("\n")
