"""Metadata forensics, run by ``refmla inspect`` and before every replay.

Structural problems were already raised by :func:`refmla.capture.validate` (exit 2); here are
the facts a kernel engineer looks for next, each answered completely (count and first position
per request), not by sampling:

    repeated_slots       a slot listed twice within one request
    req_to_token         kv_indices == req_to_token[b, :seq_len] (when the capture has it)
    zero_rows            attended KV rows that are all zero (a transfer that had not landed)
    partial_zero_rows    attended rows whose latent or rope part alone is all zero
    nonfinite_rows       attended KV rows holding NaN / Inf
    padding_slot         physical slot 0 attended (SGLang reserves it for padded tokens); a note

Every fact is a *finding* (a dict with ``check``, ``severity``, ``request``, ``rid``, the numbers
and a ``message``). Errors make a capture invalid; warnings are suspicious facts (``inspect``
exits 1 on them, a replay still runs); notes are printed but change nothing.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import numpy as np
import torch

from refmla.capture import Capture

ROW_CHUNK = 16384  # pool rows tested at a time (18 MB of bf16 at D = 576)


def check_capture(cap: Capture) -> dict:
    """{"ok", "errors", "warnings", "findings"} for one capture.

    ``errors`` / ``warnings`` are one line each (the contract's shape); ``findings`` holds the
    same facts as structured dicts, plus the notes.
    """
    findings: list[dict] = []
    with single_thread():  # many small index operations: intra-op threads only add barrier waits
        findings += repeated_slots(cap)
        findings += req_to_token_agreement(cap)
        findings += row_contents(cap)
        findings += padding_slot(cap)
    errors = [f["message"] for f in findings if f["severity"] == "error"]
    warnings = list(cap.warnings) + [f["message"] for f in findings if f["severity"] == "warning"]
    return {"ok": not errors, "errors": errors, "warnings": warnings, "findings": findings}


# --------------------------------------------------------------------------------------------
# Helpers shared with diffkv / series
# --------------------------------------------------------------------------------------------


@contextlib.contextmanager
def single_thread() -> Iterator[None]:
    """torch.set_num_threads(1) within the block, restored after.

    For code made of many small index operations on a machine shared with other work: each
    intra-op parallel region waits at a barrier for every thread, and a descheduled thread costs
    a scheduler time slice (measured: 20 ms per 4096-element index on 2 loaded cores, 0.02 ms with
    one thread). The bulk work here is numpy / memcmp, which does not use torch threads anyway.
    """
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def per_request(flags: torch.Tensor, indptr: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position flags [nnz] grouped by ``indptr`` [B + 1] -> (count [B], first position [B]).

    ``first`` is the position within the request (0-based) of the first flagged entry, -1 if none.
    """
    indptr = indptr.long()
    c = torch.zeros(flags.numel() + 1, dtype=torch.int64)
    c[1:] = torch.cumsum(flags.long(), 0)  # [nnz + 1]
    count = c[indptr[1:]] - c[indptr[:-1]]  # [B]
    hit = torch.nonzero(flags).flatten()  # [K] sorted
    k = torch.searchsorted(hit, indptr[:-1])  # [B] first hit at or after each request's start
    first = torch.full_like(count, -1)
    has = count > 0
    first[has] = hit[k[has]] - indptr[:-1][has]
    return count, first


# dtype -> (integer view, mask that drops the sign bit (zero test), (mask, value) of NaN/Inf bit patterns)
_BITS = {
    torch.bfloat16: (torch.int16, 0x7FFF, (0x7F80, 0x7F80)),
    torch.float16: (torch.int16, 0x7FFF, (0x7C00, 0x7C00)),
    torch.float32: (torch.int32, 0x7FFFFFFF, (0x7F800000, 0x7F800000)),
    torch.float64: (torch.int64, 0x7FFFFFFFFFFFFFFF, (0x7FF0000000000000, 0x7FF0000000000000)),
    torch.float8_e4m3fn: (torch.uint8, 0x7F, (0x7F, 0x7F)),  # no Inf; NaN is S.1111.111
    torch.float8_e5m2: (torch.uint8, 0x7F, (0x7C, 0x7C)),
    torch.float8_e4m3fnuz: (torch.uint8, 0xFF, (0xFF, 0x80)),  # no -0; 0x80 is the NaN
    torch.float8_e5m2fnuz: (torch.uint8, 0xFF, (0xFF, 0x80)),
}


def row_flags(kv_buffer: torch.Tensor, rows: torch.Tensor, kv_lora_rank: int) -> dict[str, torch.Tensor]:
    """For each pool row in ``rows`` [R]: zero / nonfinite / latent_zero / rope_zero, bool [R].

    Tested on the bit patterns (numpy, in chunks): a value is zero when all its bits but the
    sign are, NaN/Inf when its exponent bits are all ones (fp8 formats by their own rules).
    """
    R = rows.numel()
    out = {k: np.zeros(R, dtype=bool) for k in ("zero", "nonfinite", "latent_zero", "rope_zero")}
    if kv_buffer.dtype not in _BITS:
        raise TypeError(f"kv_buffer dtype {kv_buffer.dtype} has no bit layout here")
    view, zmask, (emask, evalue) = _BITS[kv_buffer.dtype]
    N, D = kv_buffer.shape[0], kv_buffer.shape[-1]
    bits = kv_buffer.reshape(N, D).contiguous().view(view).numpy()  # [N, D] no copy
    r = rows.long().numpy()
    dense = R > 0 and int(r[-1]) - int(r[0]) == R - 1 and bool((r[1:] > r[:-1]).all())
    Dv = min(kv_lora_rank, D)
    for s in range(0, R, ROW_CHUNK):
        e = min(s + ROW_CHUNK, R)
        v = bits[r[s] : r[s] + e - s] if dense else bits[r[s:e]]  # [c, D]
        lat = (v[:, :Dv] & zmask).any(1)  # latent part holds a nonzero
        rope = (v[:, Dv:] & zmask).any(1) if D > Dv else np.zeros(e - s, dtype=bool)
        out["zero"][s:e] = ~lat & ~rope
        out["latent_zero"][s:e] = ~lat
        out["rope_zero"][s:e] = ~rope if D > Dv else False
        out["nonfinite"][s:e] = ((v & emask) == evalue).any(1)
    return {k: torch.from_numpy(v) for k, v in out.items()}


def rid_of(cap: Capture, b: int) -> Optional[str]:
    rids = cap.meta.rids
    return rids[b] if rids is not None and b < len(rids) else None


def _who(cap: Capture, b: int) -> str:
    rid = rid_of(cap, b)
    return f"request {b}" + (f" (rid {rid})" if rid is not None else "")


def _finding(cap: Capture, check: str, severity: str, b: Optional[int], message: str, **numbers: Any) -> dict:
    return {
        "check": check, "severity": severity, "request": b,
        "rid": rid_of(cap, b) if b is not None else None, **numbers, "message": message,
    }  # fmt: skip


# --------------------------------------------------------------------------------------------
# The checks
# --------------------------------------------------------------------------------------------


def repeated_slots(cap: Capture) -> list[dict]:
    """A slot listed twice within one request means two positions read the same KV row."""
    found = []
    indptr = cap.kv_indptr.long()
    for b in range(cap.batch_size):
        idx = cap.kv_indices[int(indptr[b]) : int(indptr[b + 1])].long()  # [L]
        if idx.numel() < 2:
            continue
        srt, order = torch.sort(idx, stable=True)
        dup = srt[1:] == srt[:-1]  # [L - 1]
        if not bool(dup.any()):
            continue
        _, counts = torch.unique(idx, return_counts=True)
        repeats = int((counts > 1).sum())
        # the first position that re-reads a slot an earlier position already read
        again = int(order[1:][dup].min())
        slot = int(idx[again])
        first = int(torch.nonzero(idx == slot)[0])
        found.append(_finding(
            cap, "repeated_slots", "warning", b,
            f"{_who(cap, b)}: {repeats} slot(s) listed more than once; slot {slot} at positions {first} and {again}",
            slots_repeated=repeats, first_position=again, slot=slot, earlier_position=first,
        ))  # fmt: skip
    return found


def req_to_token_agreement(cap: Capture) -> list[dict]:
    """kv_indices[kv_indptr[b]:kv_indptr[b+1]] == req_to_token[b, :seq_len[b]] for every request.

    Both are in the capture's row numbering (write_capture remaps req_to_token when it compacts
    the pool; an entry that was outside the pool becomes -1). Where they differ, says whether the
    two rows at least hold the same bytes (same KV, different slot) or not.
    """
    r2t = cap.req_to_token
    if r2t is None:
        return []
    found = []
    indptr, seq = cap.kv_indptr.long(), cap.seq_lens.long()
    M = r2t.shape[1]
    N = cap.kv_buffer.shape[0]
    for b in range(cap.batch_size):
        L = int(seq[b])
        idx = cap.kv_indices[int(indptr[b]) : int(indptr[b + 1])].long()  # [L]
        if L > M:
            found.append(_finding(
                cap, "req_to_token", "warning", b,
                f"{_who(cap, b)}: req_to_token row holds {M} entries but seq_len is {L}; positions {M}.. unchecked",
                count=None, first_position=M,
            ))  # fmt: skip
        n = min(L, M)
        row = r2t[b, :n].long()  # [n]
        diff = row != idx[:n]
        if not bool(diff.any()):
            continue
        count = int(diff.sum())
        j = int(torch.nonzero(diff)[0])
        a, r = int(idx[j]), int(row[j])
        same = 0 <= r < N and torch.equal(cap.kv_buffer[a], cap.kv_buffer[r])
        phys = ""
        if cap.orig_kv_indices is not None:
            phys = f" (physical slot {int(cap.orig_kv_indices[int(indptr[b]) + j])})"
        what = "outside the pool" if r < 0 else ("same KV bytes, other slot" if same else "different KV rows")
        found.append(_finding(
            cap, "req_to_token", "warning", b,
            f"{_who(cap, b)}: kv_indices != req_to_token at {count} of {n} positions, first position {j}: "
            f"kv_indices {a}{phys} vs req_to_token {r} ({what})",
            count=count, first_position=j, kv_indices=a, req_to_token=r, same_bytes=bool(same),
        ))  # fmt: skip
    return found


def row_contents(cap: Capture) -> list[dict]:
    """All-zero, partly zero and NaN/Inf rows at attended slots, count and first position per request."""
    idx = cap.kv_indices.long()
    if idx.numel() == 0:
        return []
    rows, inverse = torch.unique(idx, return_inverse=True)  # each pool row converted once
    flags = {k: v[inverse] for k, v in row_flags(cap.kv_buffer, rows, cap.meta.kv_lora_rank).items()}  # [nnz]
    flags["latent_zero"] &= ~flags["zero"]
    flags["rope_zero"] &= ~flags["zero"]
    what = {
        "zero_rows": ("zero", "all-zero KV rows"),
        "latent_zero_rows": ("latent_zero", "rows whose latent part (first kv_lora_rank dims) alone is all zero"),
        "rope_zero_rows": ("rope_zero", "rows whose rope part (last qk_rope_head_dim dims) alone is all zero"),
        "nonfinite_rows": ("nonfinite", "KV rows holding NaN/Inf"),
    }
    found = []
    indptr, seq = cap.kv_indptr.long(), cap.seq_lens.long()
    for check, (key, text) in what.items():
        count, first = per_request(flags[key], indptr)
        for b in torch.nonzero(count).flatten().tolist():
            n, j = int(count[b]), int(first[b])
            slot = int(idx[int(indptr[b]) + j])
            found.append(_finding(
                cap, check, "warning", b,
                f"{_who(cap, b)}: {n} of {int(seq[b])} attended positions are {text}, first position {j} (row {slot})",
                count=n, first_position=j, row=slot,
            ))  # fmt: skip
    return found


def padding_slot(cap: Capture) -> list[dict]:
    """Physical slot 0 is SGLang's padding slot; a request attending it had unfilled metadata.

    Only known from orig_kv_indices (physical slots), and only a note: a capture written by
    other tools may number slots from 0.
    """
    if cap.orig_kv_indices is None:
        return []
    count, first = per_request(cap.orig_kv_indices.long() == 0, cap.kv_indptr)
    found = []
    for b in torch.nonzero(count).flatten().tolist():
        n, j = int(count[b]), int(first[b])
        message = (
            f"{_who(cap, b)}: attends physical slot 0 (SGLang's padding slot) at {n} position(s), first position {j}"
        )
        found.append(_finding(cap, "padding_slot", "note", b, message, count=n, first_position=j))
    return found


# --------------------------------------------------------------------------------------------
# `refmla inspect`: entries, text, exit code
# --------------------------------------------------------------------------------------------


def inspect_captures(paths: list[str]) -> list[dict]:
    """One entry per path: capture, meta, tensors (shape, dtype), metadata (check_capture); an
    unreadable file gets ``error``. With several paths every readable one also gets ``series``
    (:func:`refmla.series.series_checks`)."""
    from refmla.capture import CaptureError, read_capture

    entries = []
    for p in paths:
        try:
            cap = read_capture(p)
        except CaptureError as e:
            entries.append({"capture": str(p), "error": str(e),
                            "metadata": {"ok": False, "errors": [str(e)], "warnings": [], "findings": []}})  # fmt: skip
            continue
        entries.append({
            "capture": cap.path, "meta": cap.meta.to_json(), "metadata": check_capture(cap),
            "tensors": {n: {"shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", "")}
                        for n, t in cap.tensors().items()},
        })  # fmt: skip
        del cap
    if len(paths) > 1:
        from refmla.series import series_checks

        series = series_checks([str(p) for p in paths])
        for e in entries:
            if e["capture"] in series:
                e["series"] = series[e["capture"]]
    return entries


def inspect_exit_code(entries: list[dict]) -> int:
    """2 if any capture is invalid, else 1 if any warning (metadata or series), else 0."""
    code = 0
    for e in entries:
        md = e["metadata"]
        series_warn = any(f.get("severity") == "warning" for f in e.get("series") or [])
        code = max(code, 2 if not md["ok"] else 1 if md["warnings"] or series_warn else 0)
    return code


def render_inspect(e: dict) -> str:
    import json

    lines = [f"capture  {e['capture']}"]
    if "error" in e:
        return "\n".join(lines + [f"invalid  {e['error']}"])
    lines.append(f"meta     {json.dumps(e['meta'], sort_keys=True)}")
    for n, t in e["tensors"].items():
        lines.append(f"  {n:<16} {str(t['shape']):<22} {t['dtype']}")
    md = e["metadata"]
    lines.append("metadata " + ("ok" if md["ok"] else "INVALID"))
    lines += [f"  warning: {w}" for w in md["warnings"]]
    lines += [f"  error: {x}" for x in md["errors"]]
    lines += [f"  note: {f['message']}" for f in md.get("findings", []) if f.get("severity") == "note"]
    if "series" in e:
        found = [f for f in e["series"] if f.get("severity") in ("warning", "note")]
        bad = any(f["severity"] == "warning" for f in found)
        lines.append(
            "series   " + ("FINDINGS" if bad else "ok") + (f" (against {found[0]['previous']})" if found else "")
        )
        lines += [f"  {f['severity']}: {f['message']}" for f in found]
    return "\n".join(lines)
