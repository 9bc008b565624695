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
    nonfinite_input      NaN / Inf in what a request attends (its q rows, heads named; its attended KV
                         rows): the replay's verdict is ``diverged`` with diagnosis ``upstream_nonfinite``

Every fact is a *finding* (refmla.results.Finding: ``check``, ``severity``, ``request``, ``rid``,
the numbers and a ``message``). Errors make a capture invalid; warnings are suspicious facts (``inspect``
exits 1 on them, a replay still runs); notes are printed but change nothing.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from refmla.capture import Capture
from refmla.pool import per_request, row_flags
from refmla.results import Finding, MetadataReport
from refmla.util import single_thread


def check_capture(cap: Capture) -> MetadataReport:
    """The metadata checks of one capture.

    ``errors`` / ``warnings`` are one line each (the contract's shape); ``findings`` holds the
    same facts as typed Findings, plus the notes.
    """
    findings: list[Finding] = []
    with single_thread():  # many small index operations: intra-op threads only add barrier waits
        findings += repeated_slots(cap)
        findings += req_to_token_agreement(cap)
        findings += row_contents(cap)
        findings += padding_slot(cap)
        findings += nonfinite_inputs(cap)
    errors = [f.message for f in findings if f.severity == "error"]
    warnings = list(cap.warnings) + [f.message for f in findings if f.severity == "warning"]
    return MetadataReport(ok=not errors, errors=errors, warnings=warnings, findings=findings)


def _finding(cap: Capture, check: str, severity: str, b: Optional[int], message: str, **numbers: Any) -> Finding:
    return Finding(check, severity, message, request=b, rid=cap.rid(b), numbers=numbers)


# --------------------------------------------------------------------------------------------
# The checks
# --------------------------------------------------------------------------------------------


def repeated_slots(cap: Capture) -> list[Finding]:
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
            f"{cap.label(b)}: {repeats} slot(s) listed more than once; slot {slot} at positions {first} and {again}",
            slots_repeated=repeats, first_position=again, slot=slot, earlier_position=first,
        ))  # fmt: skip
    return found


def req_to_token_agreement(cap: Capture) -> list[Finding]:
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
                f"{cap.label(b)}: req_to_token row holds {M} entries but seq_len is {L}; positions {M}.. unchecked",
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
            f"{cap.label(b)}: kv_indices != req_to_token at {count} of {n} positions, first position {j}: "
            f"kv_indices {a}{phys} vs req_to_token {r} ({what})",
            count=count, first_position=j, kv_indices=a, req_to_token=r, same_bytes=bool(same),
        ))  # fmt: skip
    return found


def row_contents(cap: Capture) -> list[Finding]:
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
                f"{cap.label(b)}: {n} of {int(seq[b])} attended positions are {text}, first position {j} (row {slot})",
                count=n, first_position=j, row=slot,
            ))  # fmt: skip
    return found


UPSTREAM = "the input is already non-finite: the fault is upstream of attention"


def nonfinite_inputs(cap: Capture) -> list[Finding]:
    """Requests whose q rows or attended KV rows hold NaN / Inf (requests that attend nothing are
    left out: their output does not read q). Every output a kernel writes from them is garbage in,
    and agreeing NaN is not agreement (docs/contract.md section 6, ``upstream_nonfinite``)."""
    seq = cap.seq_lens.long()
    bad_q = ~torch.isfinite(cap.q.float()).all(dim=-1)  # [T, H]
    heads_of = torch.zeros(cap.batch_size, cap.num_heads, dtype=torch.bool)  # [B, H]
    heads_of.index_put_((cap.request_of_row(),), bad_q, accumulate=True)
    idx = cap.kv_indices.long()
    kv_count = torch.zeros(cap.batch_size, dtype=torch.long)
    if idx.numel():
        rows, inverse = torch.unique(idx, return_inverse=True)
        nonfinite = row_flags(cap.kv_buffer, rows, cap.meta.kv_lora_rank)["nonfinite"][inverse]  # [nnz]
        kv_count, _ = per_request(nonfinite, cap.kv_indptr.long())
    found = []
    for b in torch.nonzero((heads_of.any(dim=1) | (kv_count > 0)) & (seq > 0)).flatten().tolist():
        heads = torch.nonzero(heads_of[b]).flatten().tolist()
        where = ([f"q (heads {id_ranges(heads)})"] if heads else []) + (
            [f"kv_buffer ({int(kv_count[b])} of {int(seq[b])} attended rows, every head)"] if kv_count[b] else [])
        what = " and ".join(where)
        found.append(_finding(
            cap, "nonfinite_input", "warning", b, f"{cap.label(b)}: NaN/Inf in {what}: {UPSTREAM}",
            q_heads=heads, kv_rows=int(kv_count[b]), where=what,
        ))  # fmt: skip
    return found


def id_ranges(ids: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2, 5"."""
    out: list[str] = []
    for i in ids:
        if out and i == int(out[-1].split("-")[-1]) + 1:
            out[-1] = f"{out[-1].split('-')[0]}-{i}"
        else:
            out.append(str(i))
    return ", ".join(out)


def padding_slot(cap: Capture) -> list[Finding]:
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
            f"{cap.label(b)}: attends physical slot 0 (SGLang's padding slot) at {n} position(s), first position {j}"
        )
        found.append(_finding(cap, "padding_slot", "note", b, message, count=n, first_position=j))
    return found
