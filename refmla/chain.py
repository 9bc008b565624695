"""A decode capture and the KV writer capture of the same step replayed together (``refmla replay
DIR``): who broke the contract between the bytes' writer and their reader.

A dense decode report that diverged is linked to each ``kv_write`` report of the same (layer_id,
tp_rank, step) whose written slots the decode attends (its physical slots, ``orig_kv_indices``):

    the decode read the bytes in another fp8 encoding (kv_fp8_encoding_mismatch written=A read=B)
      and the writer stored B's bytes into its A pool (its own kv_fp8_encoding_mismatch): the
      writer's -- the decode kernel read the bytes as they were written
      and the writer stored A as documented: the reader's -- the decode kernel broke the contract
    the writer's pool dtype is another than the decode capture's KV dtype: the contract's (the two
      sides disagree on the encoding)

And a writer call that wrote none of its rows (``kv_tokens_not_written``, every token) is linked to
the writer capture of another layer of the same (tp_rank, step) whose kept rows at those slots (before
or after its own call) hold exactly this call's documented rows: ``kv_written_to_other_layer``
(``layer``, ``writer_capture``, ``rows``: which of its rows held them), the call's rows written
into another layer's buffer.

The decode report's diagnosis becomes ``kv_contract`` (or keeps it) with a text naming the writer's
capture and whose it is; a metadata finding ``kv_writer_link`` (``writer``, ``slots``, ``whose``)
records the link. Nothing here raises into the reports: a link that cannot be read is skipped.
"""

from __future__ import annotations

from typing import Optional

import torch

from refmla.capture import read_capture
from refmla.kvwrite.io import read_kv_write
from refmla.kvwrite.judge import mismatch
from refmla.kvwrite.reference import same_bytes
from refmla.results import Alternative, Explanation, Finding, ReplayReport
from refmla.util import dtype_name

ENCODING = "kv_fp8_encoding_mismatch"


def link_writers(reports: list[ReplayReport]) -> None:
    """Name the writer's or the contract's part in each diverging decode report (module docstring)."""
    writers: dict[tuple, list[ReplayReport]] = {}
    for r in reports:
        if r.kind == "kv_write" and r.verdict in ("agree", "diverged") and None not in (r.key()[0], r.key()[2]):
            writers.setdefault(r.key(), []).append(r)
    for r in reports:
        if r.kind != "dense" or r.verdict != "diverged" or r.key() not in writers:
            continue
        for w in writers[r.key()]:
            try:
                found = _link(r, w)
            except Exception:  # an aid across captures: never the cost of the reports themselves
                continue
            if found is not None:
                _apply(r, w, *found)
                break


def _link(r: ReplayReport, w: ReplayReport) -> Optional[tuple[str, str, list[int]]]:
    """(whose, sentence, slots) when the writer's capture explains the decode's divergence, else None."""
    cap, wcap = read_capture(r.capture), read_kv_write(w.capture)
    phys = cap.orig_kv_indices if getattr(cap, "orig_kv_indices", None) is not None else cap.kv_indices
    slots = sorted(set(wcap.slots.tolist()) & set(phys.long().tolist()))
    if not slots:
        return None
    pool, read_as = w.meta.kv_dtype, dtype_name(cap.kv_buffer.dtype)
    e = r.backends["observed"].explanation if "observed" in r.backends else None
    we = w.backends["observed"].explanation if w.verdict == "diverged" else None
    if e is not None and e.hypothesis == ENCODING:
        if we is not None and we.hypothesis == ENCODING and we.detail["written"] == e.detail["read"]:
            return ("the writer's", f"the KV writer of this step ({w.meta.writer}, {w.capture}) stored "
                    f"{we.detail['written']} bytes into its {pool} pool at slot(s) {_few(slots)}; the decode kernel "
                    f"read them as they were written ({e.detail['read']}): the writer broke the contract, not the "
                    f"decode kernel", slots)  # fmt: skip
        if w.verdict == "agree" and pool == e.detail["written"]:
            return ("the reader's", f"the KV writer of this step ({w.meta.writer}, {w.capture}) stored {pool} as "
                    f"documented at slot(s) {_few(slots)}; the decode kernel read {e.detail['read']}: the reader "
                    f"broke the contract", slots)  # fmt: skip
    if pool != read_as and cap.kv_buffer.dtype.itemsize == 1 and pool.startswith("float8"):
        return ("the contract's", f"the KV writer of this step ({w.meta.writer}, {w.capture}) writes a {pool} pool "
                f"and this decode capture holds it as {read_as} (slot(s) {_few(slots)}): the two sides disagree on "
                f"the encoding", slots)  # fmt: skip
    return None


def _apply(r: ReplayReport, w: ReplayReport, whose: str, sentence: str, slots: list[int]) -> None:
    r.diagnosis = "kv_contract"
    r.diagnosis_text = f"kv_fp8_encoding_mismatch ({whose}): {sentence}; {r.diagnosis_text}"
    f = Finding("kv_writer_link", "warning", sentence, numbers={"writer": w.capture, "slots": slots[:16], "whose": whose})
    r.metadata.findings.append(f)
    r.metadata.warnings.append(sentence)


def link_layers(reports: list[ReplayReport]) -> None:
    """``kv_written_to_other_layer`` for each writer call whose rows went to another layer's buffer
    (module docstring); its report's explanation and text say which layer."""
    writes = [r for r in reports if r.kind == "kv_write" and r.verdict in ("agree", "diverged") and r.meta is not None]
    for r in writes:
        e = r.backends["observed"].explanation if r.verdict == "diverged" else None
        if e is None or e.hypothesis != "kv_tokens_not_written" or not e.detail.get("every_token"):
            continue
        for o in writes:
            if o is r or o.meta.layer_id == r.meta.layer_id or (o.meta.tp_rank, o.meta.step) != (r.meta.tp_rank, r.meta.step):
                continue
            try:
                found = _other_layer(r, o)
            except Exception:  # an aid across captures: never the cost of the reports themselves
                continue
            if found is not None:
                found.other_causes.append(Alternative(e.hypothesis, e.detail, None, 0.0))
                r.backends["observed"].explanation = found
                r.diagnosis_text = (f"kv_written_to_other_layer: the KV writer {r.meta.writer} wrote this call's rows "
                                    f"into layer {o.meta.layer_id}'s buffer ({o.capture}); {r.diagnosis_text}")  # fmt: skip
                break


def _other_layer(r: ReplayReport, o: ReplayReport) -> Optional[Explanation]:
    cap, other = read_kv_write(r.capture), read_kv_write(o.capture)
    if other.meta.kv_dtype != cap.meta.kv_dtype or other.rows_after.shape[1] != cap.rows_after.shape[1]:
        return None
    kept = other.pool_slots.tolist()
    if not all(int(s) in kept for s in cap.slots.tolist()):
        return None
    rows = mismatch(cap).rows  # [T, D] this call's documented rows
    at = torch.tensor([kept.index(int(s)) for s in cap.slots.tolist()])
    for name in ("rows_before", "rows_after"):
        if bool(same_bytes(getattr(other, name)[at], rows).all()):
            return Explanation("kv_written_to_other_layer", None, {"layer": other.meta.layer_id, "writer_capture": o.capture,
                               "rows": name, "tokens": list(range(cap.tokens)), "slots": cap.slots.tolist()}, 0.0)  # fmt: skip
    return None


def _few(slots: list[int]) -> str:
    return ", ".join(map(str, slots[:8])) + (", ..." if len(slots) > 8 else "")


__all__ = ["link_layers", "link_writers"]
