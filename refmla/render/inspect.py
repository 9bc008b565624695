"""One `refmla inspect` entry as text."""

from __future__ import annotations

import json

from refmla.inspection import InspectEntry
from refmla.sparse.render import render_sparse_inspect
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
        lines.append(f"plan     {'ok' if p.ok else 'VIOLATIONS'}: {p.source}, {p.work_items} work items, "
                     f"{p.kernel_heads} heads" + ("" if p.ok else f"; first: {p.first.kind}"))  # fmt: skip
        lines += [f"  {v.kind}: {v.message}" for v in p.violations]
    if e.series is not None:
        found = [f for f in e.series if f.severity in ("warning", "note")]
        bad = any(f.severity == "warning" for f in found)
        against = f" (against {found[0].numbers['previous']})" if found else ""
        lines.append("series   " + ("FINDINGS" if bad else "ok") + against)
        lines += [f"  {f.severity}: {f.message}" for f in found]
    return "\n".join(printable(line) for line in lines)  # each line holds file text: one line each
