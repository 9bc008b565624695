"""One `refmla inspect` entry as text."""

from __future__ import annotations

import json

from refmla.inspection import InspectEntry
from refmla.sparse.inspection import SparseInspection
from refmla.util import printable


def render_inspect(e: InspectEntry) -> str:
    lines = [f"capture  {e.capture}"]
    if e.error is not None:
        return "\n".join(lines + [f"invalid  {e.error}"])
    lines.append(f"meta     {json.dumps(e.meta, sort_keys=True)}")
    lines += [f"  {n:<16} {str(t['shape']):<22} {t['dtype']}" for n, t in e.tensors.items()]
    if e.sparse is not None:
        lines += render_sparse_inspect(e.sparse)
    if e.described is not None:
        lines.append(f"kind     {e.meta.get('mode')}: " + ", ".join(f"{k} {v}" for k, v in e.described.items()))
    md = e.metadata
    lines.append("metadata " + ("ok" if md.ok else "INVALID"))
    lines += [f"  warning: {w}" for w in md.warnings]
    lines += [f"  error: {x}" for x in md.errors]
    lines += [f"  note: {f.message}" for f in md.findings if f.severity == "note"]
    if e.region is not None:
        head = {"finding": "FINDING", "warning": "WARNING"}.get(e.region.status, e.region.status.replace("_", " "))
        lines.append(f"region   {head}: {e.region.message}")
    if e.plan is not None:
        p = e.plan
        heads = f", {p.kernel_heads} heads" if p.kernel_heads else ""
        lines.append(f"plan     {'ok' if p.ok else 'VIOLATIONS'}: {p.source}, {p.work_items} {p.unit}{heads}"
                     + ("" if p.ok else f"; first: {p.first.kind}"))  # fmt: skip
        lines += [f"  {v.kind}: {v.message}" for v in p.violations]
    if e.series is not None:
        found = [f for f in e.series if f.severity in ("warning", "note")]
        bad = any(f.severity == "warning" for f in found)
        against = f" (against {found[0].numbers['previous']})" if found else ""
        lines.append("series   " + ("FINDINGS" if bad else "ok") + against)
        lines += [f"  {f.severity}: {f.message}" for f in found]
    return "\n".join(printable(line) for line in lines)  # each line holds file text: one line each


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
        if c.positions_held is not None:
            lines.append(f"  {'':<13} KV map: {c.positions_held} positions held over the requests"
                         + (", production pages recorded" if c.page_map else ", no page map (no transfer runs)"))
    if s.disagg_mode is not None:
        lines.append(f"  disagg {s.disagg_mode} node")
    lines.append(f"  rows   {s.lonely_rows} lonely (no valid entry: out 0, lse +inf); stored outputs: "
                 + (", ".join(s.outputs) or "none"))
    if s.pool_regions:
        lines.append(f"  pool   {s.pool_class or 'pool'}: {len(s.pool_regions)} registered buffers, bytes "
                     + ", ".join(str(b) for b in s.pool_regions) + f" (largest {max(s.pool_regions)})")
    return lines
