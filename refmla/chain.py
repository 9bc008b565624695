"""A decode capture and the KV writer capture of the same step replayed together (``refmla replay
DIR``): who broke the contract between the bytes' writer and their reader.

A decode report that diverged (dense token slots, a vLLM block table: its token rows
``block * block_size + offset``, the slot mapping's numbering; a sparse decode: its main cache's
valid indices, the V4 writer's SWA slots) is linked to each ``kv_write`` report of the same
(layer_id, tp_rank, step) whose written slots the decode attends (its physical slots,
``orig_kv_indices``):

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

And a writer call whose tokens were not written at their slots (``kv_tokens_not_written``) is
linked to a decode capture of the same (layer_id, tp_rank, step) whose pool holds those tokens'
documented rows at other slots: ``kv_written_to_stale_rows`` (``written_to``: the slots that hold
them, ``seen_in``: the decode capture; ``slot_mapping_of``: the step of another writer capture of the
layer whose slots those are -- the call wrote through that step's stale slot mapping).

:func:`link` runs every link (``refmla replay DIR`` and ``refmla.api.replay_folder``).

The decode report's diagnosis becomes ``kv_contract`` (or keeps it) with a text naming the writer's
capture and whose it is; a metadata finding ``kv_writer_link`` (``writer``, ``slots``, ``whose``)
records the link. Nothing here raises into the reports: a link that cannot be read is skipped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from refmla.capture import read_capture
from refmla.kvwrite.io import read_kv_write
from refmla.kvwrite.judge import mismatch
from refmla.kvwrite.reference import same_bytes
from refmla.results import Alternative, Explanation, Finding, ReplayReport
from refmla.sparse.format import SPARSE_MODE
from refmla.sparse.layouts import token_rows
from refmla.sparse.validation import read_sparse
from refmla.util import dtype_name

ENCODING = "kv_fp8_encoding_mismatch"
READERS = ("dense", SPARSE_MODE)  # the report kinds a writer's bytes are read by


def link(reports: list[ReplayReport]) -> None:
    """Every link across the reports of one folder (module docstring); never raises."""
    link_writers(reports)
    link_layers(reports)
    link_stale_rows(reports)


@dataclass
class ReaderPool:
    """What a decode capture holds of the pool its writer wrote: the physical slots it attends and
    their rows' bytes ([n, row bytes] uint8; a sparse cache's token rows as a packed writer keeps them)."""

    slots: torch.Tensor  # [n] int64, distinct
    rows: torch.Tensor  # [n, row bytes] uint8
    kv_dtype: str  # the fp8 (or other) dtype the capture says the pool is


def reader_pool(r: ReplayReport) -> ReaderPool:
    if r.kind == SPARSE_MODE:
        cap = read_sparse(r.capture)
        m = cap.meta
        idx = cap.indices.long().flatten()
        tokens = torch.unique(idx[(idx >= 0) & (idx < cap.k_cache.shape[0] * m.page_size)])
        return ReaderPool(tokens, token_rows(cap.k_cache, m.layout, m.page_size)[tokens], m.kv_fp8_dtype)
    cap = read_capture(r.capture)
    phys = cap.orig_kv_indices if getattr(cap, "orig_kv_indices", None) is not None else cap.kv_indices
    phys, rows = phys.long(), cap.kv_indices.long()
    first = {int(p): i for i, p in reversed(list(enumerate(phys.tolist())))}
    at = torch.tensor(list(first.values()), dtype=torch.long)
    kv = cap.kv_buffer.reshape(cap.kv_buffer.shape[0], -1)[rows[at]]
    return ReaderPool(phys[at], kv.contiguous().view(torch.uint8), dtype_name(cap.kv_buffer.dtype))


def link_writers(reports: list[ReplayReport]) -> None:
    """Name the writer's or the contract's part in each diverging decode report (module docstring)."""
    writers: dict[tuple, list[ReplayReport]] = {}
    for r in reports:
        if r.kind == "kv_write" and r.verdict in ("agree", "diverged") and None not in (r.key()[0], r.key()[2]):
            writers.setdefault(r.key(), []).append(r)
    for r in reports:
        if r.kind not in READERS or r.verdict != "diverged" or r.key() not in writers:
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
    rp, wcap = reader_pool(r), read_kv_write(w.capture)
    slots = sorted(set(wcap.slots.tolist()) & set(rp.slots.tolist()))
    if not slots:
        return None
    pool, read_as = w.meta.kv_dtype, rp.kv_dtype
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
    if pool != read_as and read_as.startswith("float8") and pool.startswith("float8"):
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


def link_stale_rows(reports: list[ReplayReport]) -> None:
    """``kv_written_to_stale_rows`` for each writer call whose unwritten tokens' rows a decode capture
    of its step holds at other slots (module docstring)."""
    writes = [r for r in reports if r.kind == "kv_write" and r.verdict == "diverged" and r.meta is not None]
    for w in writes:
        e = w.backends["observed"].explanation
        if e is None or e.hypothesis != "kv_tokens_not_written":
            continue
        for r in reports:
            if r.kind not in READERS or r.verdict not in ("agree", "diverged") or r.key() != w.key():
                continue
            try:
                found = _stale(w, r, e, [o for o in reports if o.kind == "kv_write" and o is not w])
            except Exception:  # an aid across captures: never the cost of the reports themselves
                continue
            if found is not None:
                found.other_causes.append(Alternative(e.hypothesis, e.detail, None, 0.0))
                w.backends["observed"].explanation = found
                w.diagnosis_text = (f"kv_written_to_stale_rows: the KV writer {w.meta.writer} wrote this call's rows "
                                    f"at slot(s) {_few(found.detail['written_to'])}, not its own ({r.capture} holds "
                                    f"them there); {w.diagnosis_text}")  # fmt: skip
                break


def _stale(w: ReplayReport, r: ReplayReport, e: Explanation, others: list[ReplayReport]) -> Optional[Explanation]:
    cap, rp = read_kv_write(w.capture), reader_pool(r)
    mm = mismatch(cap)
    rows = mm.rows.contiguous().view(torch.uint8)  # [T, row bytes] the documented rows
    width = mm.width or rows.shape[1]
    if rp.rows.shape[1] < width or (not cap.meta.packed and rp.kv_dtype != cap.meta.kv_dtype):
        return None
    tokens, landed = list(e.detail["tokens"]), []
    for t in tokens:
        hit = (rp.rows[:, :width] == rows[t, :width][None]).all(-1)  # [n]
        at = [int(s) for s in rp.slots[hit].tolist() if int(s) != int(cap.slots[t])]
        if not at:
            return None
        landed.append(at[0])
    detail = {"tokens": tokens, "slots": [int(cap.slots[t]) for t in tokens], "written_to": landed,
              "every_token": len(tokens) == cap.tokens, "seen_in": r.capture}  # fmt: skip
    for o in others:  # the slot mapping those slots are: another step's writer of this layer
        if o.meta is not None and (o.meta.layer_id, o.meta.tp_rank) == (w.meta.layer_id, w.meta.tp_rank) \
                and o.meta.step != w.meta.step and set(landed) <= set(read_kv_write(o.capture).slots.tolist()):
            detail["slot_mapping_of"] = {"step": o.meta.step, "writer_capture": o.capture}
            break
    return Explanation("kv_written_to_stale_rows", None, detail, 0.0)


def _few(slots: list[int]) -> str:
    return ", ".join(map(str, slots[:8])) + (", ..." if len(slots) > 8 else "")


__all__ = ["READERS", "ReaderPool", "link", "link_layers", "link_stale_rows", "link_writers", "reader_pool"]
