"""Text for people: one sparse replay report as a table and its diagnosis; a sparse capture's
inspect description (refmla.render.inspect prints it under the dense part)."""

from __future__ import annotations

from refmla.sparse.inspection import SparseInspection
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
        f"layer {m.get('layer_id', '-')} compress_ratio {m.get('compress_ratio', '-')} ({m.get('layer_role', '-')})  "
        f"produced by {m['backend']}",
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
    d = r.diagnosis  # as dense replay prints it (refmla.render.replay)
    lines += ["", f"verdict  {r.verdict}", f"diagnosis {d.name}: {d.text}" if d.name else f"diagnosis {d.text}"]
    if r.region is not None and r.region.status != "not_recorded":
        lines.append(f"region   {r.region.status}: {r.region.message}")
    return "\n".join(lines)


def _lengths(lo, hi) -> str:
    return "no topk_length (the width is read)" if lo is None else f"topk_length {lo}..{hi}"


def render_sparse_inspect(s: SparseInspection) -> list[str]:
    """The sparse part of `refmla inspect`: layout, caches and their geometry, top-k, ratio, regions."""
    sh = s.shape
    ratio = "-" if s.compress_ratio is None else s.compress_ratio
    lines = [f"sparse   layout {s.layout}: {s.model_layout}; produced by {s.kernel_backend}",
             f"  shape  requests={sh['B']} q_tokens={sh['S']} heads={sh['H']} D={sh['D']} Dv={sh['Dv']}  q {s.q_dtype}  "
             f"softmax_scale {s.softmax_scale:.6g}  sink {'yes' if s.sink else 'no'}",
             f"  layer  compress_ratio {ratio} ({s.layer_role or '-'})  window {s.window if s.window is not None else '-'}  "
             f"fp8 {s.kv_fp8_dtype}"]  # fmt: skip
    for c in s.caches:
        lines += [f"  {c.name:<13} {c.role}: layout {c.layout}, {c.pages} pages x {c.page_size} tokens = {c.tokens} tokens, "
                  f"page stride {c.page_stride} bytes (layout needs {c.layout_page_bytes})",
                  f"  {'':<13} top-k width {c.index_width}, {_lengths(c.length_min, c.length_max)}, "
                  f"{c.valid_entries} entries read",
                  f"  {'':<13} packing {c.packing}"]  # fmt: skip
    lines.append(f"  rows   {s.lonely_rows} lonely (no valid entry: out 0, lse +inf); stored outputs: "
                 + (", ".join(s.outputs) or "none"))
    if s.pool_regions:
        lines.append(f"  pool   {s.pool_class or 'pool'}: {len(s.pool_regions)} registered buffers, bytes "
                     + ", ".join(str(b) for b in s.pool_regions) + f" (largest {max(s.pool_regions)})")
    return lines


__all__ = ["render_sparse", "render_sparse_inspect"]
