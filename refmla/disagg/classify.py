"""Where a row's fault is -- transfer, metadata, compute or none -- and the sentences that say so.

Precedence, the cause before its symptoms:

    writer     the prefill node's KV writer stored rows that are not the documented ones
               (refmla.disagg.writer): every later link carries the wrong rows faithfully
    metadata   a structural finding (repeated slots, kv_indices != req_to_token, seq_len not +1
               per step): the decode side read the wrong rows, whatever the transfer did
    transfer   the decode rows differ from the prefill rows (diff-kv), or the KV region is over the
               MR limit (refmla.region_check: MORI cannot register it, the KV never arrives)
    metadata   any other metadata or series warning (zero / NaN rows, rows changed between steps),
               or a decode capture that is invalid (nothing replayed)
    compute    a compute path diverges over KV that arrived intact and metadata that is right (with
               only production's output diverging: production's own kernel call, PRODUCTION_CALL)
    none       all three answers are clean
"""

from __future__ import annotations

from refmla.capture.rows import TIER_TEXT
from refmla.diffkv.views import SECTION_TEXT
from refmla.disagg.report import CLASSES, Row

STRUCTURAL = ("repeated_slots", "req_to_token", "seq_len_step")

# a ``compute`` row whose decode diagnosis is ``observed`` over KV that arrived intact: the compute that
# failed is production's own kernel call, not the kernels' math on the captured inputs
PRODUCTION_CALL = (
    "production's decode call diverged at step {step} (observed) while the offline kernels agree on the captured "
    "inputs and the KV arrived intact: the fault is in that call's compute, its kernel build or what it read at "
    "call time (KV landing or overwritten around the call, graph replay, metadata changed after the call), not "
    "in the transfer nor in the kernels' math; refmla replay {capture} lists the next steps that tell these apart"
)


def classify(row: Row) -> tuple[str, str]:
    """(class, one sentence naming the request, layer, rank and the evidence)."""
    md, where = row.metadata, row.where()
    if row.writer is not None and row.writer.bad:  # the first link: wrong rows were written, then faithfully sent
        return "writer", (f"{where}: the prefill KV writer stored wrong rows (written -> transferred -> read: the "
                          f"write broke): {row.writer.diagnosis}: {row.writer.diagnosis_text} ({row.writer.capture})")  # fmt: skip
    structural = [f for _, f in md.problems if f.check in STRUCTURAL]
    if structural:
        return "metadata", f"{where}: the decode metadata is wrong: {structural[0].message}"
    region_over = md.region is not None and md.region.is_finding
    if row.transfer.bad:
        why = f"; the cause: {md.region.message} ({md.region_capture})" if region_over else ""
        return "transfer", f"{where}: {transfer_text(row)}{why}"
    if region_over:
        return "transfer", f"{where}: the KV never arrives: {md.region.message} ({md.region_capture})"
    if md.problems:
        _, f = md.problems[0]
        return "metadata", f"{where}: {f.check}: {f.message}"
    if row.decode.verdict == "invalid":
        return "metadata", f"{where}: the decode capture is invalid: {row.decode.diagnosis_text} ({row.decode.capture})"
    if row.decode.bad:
        d = row.decode
        expl = f"; {d.explanation}" if d.explanation else ""
        if d.diagnosis == "observed" and row.transfer.status == "faithful":
            return "compute", f"{where}: {PRODUCTION_CALL.format(step=d.step, capture=d.capture)}{expl}"
        return "compute", f"{where}: {d.diagnosis} at step {d.step}: {d.diagnosis_text}{expl}"
    unchecked = "" if row.transfer.status == "faithful" else f" (transfer not checked: {row.transfer.note})"
    return "none", f"{where}: clean{unchecked}"


def transfer_text(row: Row) -> str:
    """The transfer mismatch: how many positions, the first position, page and MORI run, and what the run holds."""
    t = row.transfer
    if t.cache_label is not None:  # a sparse pair: the cache, its page and the request first
        r = t.ratio or 1
        tokens = f"; entry {t.first_mismatch} holds tokens [{t.first_mismatch * r}, {(t.first_mismatch + 1) * r})" if r > 1 else ""
        text = (f"the transfer is not faithful: {t.cache_label} page {t.first_page} of {row.rid}: "
                f"{t.mismatched_positions} of {t.positions_compared} positions of that cache differ, "
                f"first position {t.first_mismatch} (page {t.first_page}{tokens})")  # fmt: skip
    elif t.reuse is not None and t.reuse.get("tier") is not None:  # paired by tokens: rows another request wrote
        tier, pages = t.reuse["tier"], t.reuse["mismatch_pages_by_origin"][t.reuse["tier"]]
        whom = sorted({w["rid"] for w in t.reuse["written_by"] if w["rid"] not in (None, row.rid)})
        text = (f"the KV reloaded from {TIER_TEXT[tier]} is not faithful: {t.mismatched_positions} of "
                f"{t.positions_compared} positions differ from the rows {', '.join(whom) or 'its writer'} wrote, "
                f"page(s) {', '.join(str(p) for p in pages[:8])}, first position {t.first_mismatch}")  # fmt: skip
        if t.decode_zero_rows:
            text += f", {t.decode_zero_rows} all-zero rows (not landed)"
        return text + ("; " + "; ".join(t.sources[:2]) if t.sources else "")
    else:
        text = (f"the transfer is not faithful: {t.mismatched_positions} of {t.positions_compared} positions differ, "
                f"first position {t.first_mismatch} (page {t.first_page})")  # fmt: skip
    run = t.run
    if run is not None:
        text += f", MORI run [{run['start']}, {run['end']})"
        if run.get("offset") is not None:
            text += f" shifted by {run['offset']:+d} position(s) (decode row j holds prefill row j{run['offset']:+d})"
        elif run.get("decode_zero_rows"):
            text += f" not landed ({run['decode_zero_rows']} all-zero rows)"
        elif t.source_rid is None and len([n for n in (t.sections or {}).values() if n]) != 1:
            text += " holds other KV"
    if t.source_rid is not None:
        text += f" holds the KV of request {t.source_rid} (same positions)"
    elif t.decode_zero_rows:
        text += f", {t.decode_zero_rows} all-zero decode rows (not landed)"
    if t.sources:
        text += "; " + "; ".join(t.sources[:2])
    only = [name for name, n in (t.sections or {}).items() if n]
    if len(only) == 1:  # packed tokens: the one section their bytes differ in
        text += f"; only the {SECTION_TEXT[only[0]]} bytes differ"
    also = [f"{c['label']} {c['mismatched_positions']}" for n, c in (t.caches or {}).items()
            if n != t.cache and c["status"] == "mismatch"]  # fmt: skip
    if also:
        text += f"; also mismatched: {', '.join(also)} position(s)"
    return text


def overall(rows: list[Row], region_findings: list[str]) -> tuple[str, str]:
    """(the highest-precedence class present, one sentence naming where the fault is)."""
    n = len(rows)
    bad = {c: [r for r in rows if r.fault == c] for c in CLASSES if c != "none"}
    present = [c for c in CLASSES if c != "none" and bad[c]]
    if not present:
        if region_findings:
            return "transfer", f"fault in the transfer: {region_findings[0]}"
        if not rows:
            return "none", "no decode request to check"
        unchecked = sum(r.transfer.status != "faithful" for r in rows)
        tail = f"; the transfer of {unchecked} row(s) was not checked (no prefill capture holds their rid)" if unchecked else ""
        return "none", (f"no fault: for all {n} (request, layer, rank) rows the KV arrived intact, the metadata is "
                        f"right and every compute path agrees with the reference{tail}")  # fmt: skip
    first = present[0]
    parts = [f"fault in the {first}: {len(bad[first])} of {n} rows, first {bad[first][0].sentence}"]
    for c in present[1:]:
        parts.append(f"also {c}: {len(bad[c])} row(s), first {bad[c][0].where()}")
    return first, "; ".join(parts)
