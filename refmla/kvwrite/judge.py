"""One KV writer capture judged: the documented rows against the rows the writer stored, bit for
bit, the difference explained (refmla.kvwrite.hypotheses), as the shared
:class:`refmla.results.ReplayReport` (backends ``reference`` and ``observed``, the verdict, a
diagnosis class of docs/contract.md section 6: ``kv_writer``, ``kv_saturated``). A packed capture
(meta ``kv_layout``) is compared the same way, byte for byte over its token rows, its mistakes
those of refmla.kvwrite.packed_hypotheses and its error in values decoded by refmla.sparse.layouts."""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch

from refmla.kvwrite import packed
from refmla.kvwrite.format import KvWriteCapture
from refmla.kvwrite.hypotheses import Mismatch, explain
from refmla.kvwrite.packed_hypotheses import explain_packed
from refmla.kvwrite.reference import expected_pool, fp8_max, same_bytes, saturated, written_rows
from refmla.results import BackendEntry, Finding, MetadataReport, ReplayReport
from refmla.util import dtype_name

REFERENCE = BackendEntry("pass", max_abs_err=0.0, cos_diff=0.0, info={"what": "the documented quantization"})


def mismatch(cap: KvWriteCapture) -> Mismatch:
    """The documented rows and which kept rows differ from them (rows of slots written twice aside)."""
    rows = written_rows(cap)
    ok = same_bytes(expected_pool(cap, rows), cap.rows_after)  # [N]
    pos = cap.positions()
    twice = {s for s, n in Counter(cap.slots.tolist()).items() if n > 1}
    skip = set(cap.padding_tokens())  # SGLang's reserved slot 0: padding, whatever it holds
    tokens = [t for t in range(cap.tokens) if not bool(ok[pos[t]]) and int(cap.slots[t]) not in twice and t not in skip]
    written = set(pos.tolist())
    others = [p for p in range(cap.pool_slots.shape[0]) if p not in written and not bool(ok[p])]
    width = packed.written_width(cap) if cap.meta.packed else None
    return Mismatch(rows=rows, tokens=tokens, others=others, width=width)


def _observed(cap: KvWriteCapture, mm: Mismatch, explain_failures: bool) -> BackendEntry:
    exp, got = expected_pool(cap, mm.rows), cap.rows_after
    same = same_bytes(exp, got)  # [N]: a row stored bit for bit has no error (NaN garbage included)
    if cap.meta.packed:  # the bytes' values, decoded (refmla.sparse.layouts)
        exp, got = packed.row_values(exp, cap), packed.row_values(got, cap)
    err = (got.double() - exp.double()).abs().nan_to_num(nan=float("inf"))[~same]
    err = err if err.numel() else torch.zeros(1)
    info: dict[str, Any] = {"writer": cap.meta.writer, "rows_compared": int(cap.pool_slots.shape[0]),
                            "tokens_written": cap.tokens, "kv_dtype": cap.meta.kv_dtype}  # fmt: skip
    if cap.meta.packed:
        info.update(kv_layout=cap.meta.kv_layout, page_size=cap.meta.page_size, packed_input=cap.meta.packed_input)
    if not mm.tokens and not mm.others:
        return BackendEntry("pass", max_abs_err=0.0, info=info)
    said = [f"{len(mm.tokens)} of {cap.tokens} written row(s) differ"] if mm.tokens else []
    if mm.tokens:
        said[0] += f" (first token {mm.tokens[0]}, slot {int(cap.slots[mm.tokens[0]])})"
    if mm.others:
        said.append(f"{len(mm.others)} row(s) the call did not write changed (slot(s) "
                    f"{', '.join(str(int(cap.pool_slots[p])) for p in mm.others[:8])})")  # fmt: skip
    info.update(differing_tokens=mm.tokens, differing_slots=[int(cap.slots[t]) for t in mm.tokens],
                changed_unwritten_slots=[int(cap.pool_slots[p]) for p in mm.others])  # fmt: skip
    entry = BackendEntry("fail", reason="; ".join(said), max_abs_err=float(err.max()), info=info)
    if explain_failures:
        entry.explanation = (explain_packed if cap.meta.packed else explain)(cap, mm)
    return entry


# the writer hypotheses that are the contract between writer and reader, not a writer's own slip
BYTES_CONTRACT = {"kv_fp8_encoding_mismatch": "kv_contract", "kv_scale_format": "kv_contract",
                  "kv_cast_overflow": "kv_saturated"}  # fmt: skip


def bytes_headline(cap: KvWriteCapture, e) -> str:
    """The report's first words when the bytes' encoding or the cast's range explains the rows."""
    d = e.detail
    if e.hypothesis == "kv_fp8_encoding_mismatch":
        return (f"kv_fp8_encoding_mismatch: the KV writer {cap.meta.writer} stored {d['written']} bytes into a pool "
                f"read as {d['read']} (a value read is {d['read_over_written']} times the one written)")  # fmt: skip
    if e.hypothesis == "kv_scale_format":
        return (f"kv_scale_format: the KV writer {cap.meta.writer} divided by its fp32 scale {d['scale']:g} read as "
                f"{d['read']} ({d['how']}: {d['value_read']:g})")  # fmt: skip
    if "range_of" in d:  # a V4 page's tiles scaled for another e4m3's range
        return (f"kv_cast_overflow: the KV writer {cap.meta.writer} scaled its tiles for {d['range_of']}'s range "
                f"(+-{fp8_max(d['range_of']):g}) and cast them into its {d['kv_dtype']} pool (+-{fp8_max(d['kv_dtype']):g}): "
                f"{d['elements']} element(s) past the range, {d['stored_nan']} stored as NaN ({d['cast']})")  # fmt: skip
    return (f"kv_cast_overflow: the scale {d['scale']:g} is too small for {d['kv_dtype']}: {d['elements']} element(s) "
            f"past its range, and the writer's cast ({d['cast']}) stored {d['stored_nan']} of them as NaN where a "
            f"saturating writer stores +-{fp8_max(d['kv_dtype']):g}")  # fmt: skip


def judge_kv_write(cap: KvWriteCapture, opts: Any = None) -> ReplayReport:
    """The report of a readable capture (module docstring); ``opts`` a ReplayOptions (its ``explain``)."""
    explain_failures = getattr(opts, "explain", True)
    findings = [Finding("kv_write", "warning", w) for w in cap.warnings]
    pad = cap.padding_tokens()
    if pad:
        findings.append(Finding("padding_slot", "note", f"{len(pad)} token(s) at SGLang's reserved slot 0 (padded "
                                f"tokens of a CUDA-graph batch): not compared", numbers={"tokens": pad[:16]}))  # fmt: skip
    sat = saturated(cap)
    if sat:
        parts = ", ".join(f"{n} {part}" for part, n in sat.items())
        findings.append(Finding("kv_saturated", "warning", f"{parts} element(s) exceed the {cap.meta.kv_dtype} range "
                                f"(+-{fp8_max(cap.meta.kv_dtype):g}) at scale {cap.scale_value():g}: stored saturated",
                                numbers={"saturated": sat, "scale": cap.scale_value()}))  # fmt: skip
    mm = mismatch(cap)
    observed = _observed(cap, mm, explain_failures)
    report = ReplayReport(capture=cap.path, verdict="agree", diagnosis=None, mode=cap.meta.mode, meta=cap.meta,  # type: ignore[arg-type]
                          metadata=MetadataReport(ok=True, warnings=[f.message for f in findings if f.severity == "warning"], findings=findings),
                          backends={"reference": REFERENCE, "observed": observed}, kind=cap.meta.mode,
                          diagnosis_backends=[])  # fmt: skip
    if observed.status == "fail":
        e = observed.explanation
        why = f"; {e.text()}" if e is not None else "; no simple writer mistake reproduces them"
        report.verdict, report.diagnosis, report.diagnosis_backends = "diverged", "kv_writer", ["observed"]
        report.diagnosis_text = f"the KV writer {cap.meta.writer} stored rows that are not the documented ones: {observed.reason}{why}"
        if e is not None and e.hypothesis in BYTES_CONTRACT:
            report.diagnosis = BYTES_CONTRACT[e.hypothesis]
            report.diagnosis_text = bytes_headline(cap, e) + f" ({observed.reason}; {e.text()})"
            if e.hypothesis == "kv_cast_overflow" and sat:
                findings[-1].message = findings[-1].message.replace("stored saturated", "stored as NaN by torch's cast")
                report.metadata.warnings[-1] = findings[-1].message
    elif sat:
        report.verdict, report.diagnosis = "diverged", "kv_saturated"
        report.diagnosis_text = (f"the writer stored what it was given, but the scale {cap.scale_value():g} is too "
                                 f"small: {findings[-1].message}")  # fmt: skip
    else:
        what = f"{cap.meta.kv_layout} pages, UE8M0 tiles" if cap.meta.packed else dtype_name(cap.meta.dtype)
        report.diagnosis_text = f"the KV writer stored every row as documented ({what})"
    return report


__all__ = ["judge_kv_write", "mismatch"]
