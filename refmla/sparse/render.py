"""Text for people: one sparse replay report as a table and its diagnosis."""

from __future__ import annotations

from refmla.sparse.replay import SparseReport


def _num(x) -> str:
    return "-" if x is None else f"{x:.3g}"


def render_sparse(r: SparseReport) -> str:
    if r.verdict == "invalid":
        return f"capture  {r.capture}\ninvalid  {r.error}"
    m, s = r.meta, r.shape
    extra = f" + extra {m.get('extra_kv_layout')} page {m.get('extra_page_size')} K={s['K_extra']}" if s.get("K_extra") else ""
    lines = [
        f"capture  {r.capture}",
        f"shape    sparse_decode  requests={s['B']} q_tokens={s['S']} heads={s['H']} D={s['D']} Dv={s['Dv']}  "
        f"layout {m['kv_layout']} page {m['page_size']} K={s['K']}{extra}  "
        f"compress_ratio {m.get('compress_ratio', '-')} ({m.get('layer_role', '-')})  produced by {m['backend']}",
        f"noise    control (the Triton sparse kernel's rounding points) max abs err {_num(r.noise)}"
        + (f"; {r.lonely_rows} row(s) with no valid index (lonely: out 0, lse +inf)" if r.lonely_rows else ""),
        "",
    ]
    rows = [("backend", "status", "max_abs_err", "cos_diff", "worst", "note")]
    for e in r.entries:
        where = f"req {e.worst.request} head {e.worst.head}" if e.worst is not None and e.worst.keys else "-"
        note = e.explanation.text() if e.explanation else (e.reasons[0] if e.status == "FAIL" and e.reasons else e.note)
        rows.append((e.backend, e.status, _num(e.max_abs_err), _num(e.cos_diff), where, note[:110]))
    widths = [max(len(str(row[i])) for row in rows) for i in range(5)]
    for i, row in enumerate(rows):
        lines.append("  ".join(str(c).ljust(w) for c, w in zip(row[:5], widths)) + "  " + row[5])
        if i == 0:
            lines.append("  ".join("-" * w for w in widths) + "  " + "-" * 10)
    lines += ["", f"verdict  {r.verdict}", f"diagnosis {r.diagnosis}"]
    if r.region is not None and r.region.status != "not_recorded":
        lines.append(f"region   {r.region.status}: {r.region.message}")
    return "\n".join(lines)


__all__ = ["render_sparse"]
