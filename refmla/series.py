"""Series checks: the captures of one layer and rank across decode steps.

A *series* is the captures of one layer on one rank, ordered by ``meta.step``. Only captures that
carry all three of ``layer_id``, ``tp_rank`` and ``step`` chain into one (:func:`in_series`); the
others (goldens, hand-made captures) get no series check, and the summaries say so once
(:func:`no_series_note`). Between consecutive captures, each request (paired by rid, else by
order; two captures with rids that share none pair nothing) must

    grow by exactly one token per decode step    seq_len[t+1] == seq_len[t] + (step[t+1] - step[t])
                                                  (an extend capture: + its new tokens)
    keep its earlier rows                         the KV rows at positions < seq_len[t] are the
                                                  same bytes in both captures

Findings are attached to the later capture's report under ``"series"``, so ``--json`` stays a
plain array of report objects.

``stale_metadata`` (issue 31): a CUDA / HIP graph replayed with the previous step's metadata
(vLLM #36611, SGLang #28028, #13740) computes the right attention under step t-1's indptr,
indices, lengths and split counts. When a capture's observed output fails and the previous
capture of its series has the same batch size, the reference and control under the previous
step's metadata (its physical slots mapped onto this capture's pool) are compared with the
output; if the comparator passes, that is the observed backend's explanation (the search's own
answer kept under ``other_causes``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import stat
from typing import Optional, Sequence

import torch

from refmla.capture import Capture, CaptureError, read_capture
from refmla.context import ReplayContext, ReplayOptions
from refmla.capture.numbers import meta_json
from refmla.capture.read import safetensors_open
from refmla.pool import rows_differ
from refmla.results import Alternative, Explanation, Finding
from refmla.util import single_thread


def _header(path: str) -> Optional[dict]:
    """The capture's meta from the safetensors header alone (no tensor is read); None if unreadable."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):  # never open a FIFO or a device
            return None
        with safetensors_open(path) as f:
            meta = meta_json((f.metadata() or {})["meta"])
    except Exception:
        return None
    return meta if isinstance(meta, dict) else None


SERIES_KEYS = ("layer_id", "tp_rank", "step")


def in_series(meta) -> bool:
    """Whether a capture's meta (a dict, or a typed meta) carries the layer, rank and step a series
    is made of: only such captures are chained and checked across steps."""
    get = meta.get if isinstance(meta, dict) else (lambda k: getattr(meta, k, None))
    return all(type(get(k)) is int for k in SERIES_KEYS)


def no_series_note(unchained: int, total: int) -> Optional[str]:
    """The one line saying which captures were not checked as a series, or None when all were."""
    if not unchained:
        return None
    return (f"series   {unchained} of {total} capture(s) in no series, not checked across steps (a series is the "
            f"dense captures of one layer and rank that carry layer_id, tp_rank and step)")  # fmt: skip


def group_series(paths: Sequence[str]) -> dict[tuple, list[str]]:
    """(layer_id, tp_rank) -> paths in step order (file order where a capture lacks a step).

    Unreadable files are left out (the replay reports them). ``refmla disagg``'s plan groups its
    decode captures with it; the series checks take only the captures :func:`in_series` admits.
    """
    groups: dict[tuple, list[tuple]] = {}
    for order, p in enumerate(paths):
        meta = _header(p)
        if meta is None:
            continue
        key = (meta.get("layer_id"), meta.get("tp_rank"))
        if not all(k is None or type(k) is int for k in key):  # a bad meta key: the replay refuses it, naming it
            continue
        groups.setdefault(key, []).append((meta.get("step"), order, p))
    out = {}
    for key, items in groups.items():
        if all(isinstance(s, int) for s, _, _ in items):
            items.sort(key=lambda t: (t[0], t[1]))
        out[key] = [p for _, _, p in items]
    return out


def series_checks(paths: Sequence[str]) -> dict[str, list[Finding]]:
    """path -> series findings of that capture (against the previous capture of its series).

    Every readable path that carries a layer, rank and step gets an entry (an empty list when
    nothing was found), the others none. Holds at most two captures in memory at a time.
    """
    found: dict[str, list[Finding]] = {}
    for group in group_series([p for p in paths if in_series(_header(p) or {})]).values():
        if len(group) == 1:  # nothing to compare it with: not even read
            found[group[0]] = []
            continue
        prev: Optional[Capture] = None
        for p in group:
            try:
                cap = read_capture(p)
            except Exception:  # CaptureError, or refmla failing on it (MemoryError, ...): the replay reports it
                continue  # the series goes on without it
            try:
                with single_thread():
                    found[p] = [] if prev is None else compare_steps(prev, cap)
            except Exception:  # one pair refmla cannot compare costs only that pair's findings
                found[p] = []
            prev = cap
    return found


def attach_series(reports: list, opts: Optional[ReplayOptions] = None) -> None:
    """Set ``report.series`` (a list of findings) on every readable capture's ReplayReport; with
    ``opts`` (the replay's) also try ``stale_metadata`` on each failing observed output."""
    found = series_checks([r.capture for r in reports])  # unreadable files are skipped there
    for r in reports:
        if r.capture in found:
            r.series = found[r.capture]
    if opts is None or not opts.explain:
        return
    by_path = {r.capture: r for r in reports}
    for group in group_series([r.capture for r in reports if r.capture in found]).values():
        for before, path in zip(group, group[1:]):
            entry = by_path[path].backends.get("observed") if path in by_path else None
            if entry is None or entry.status != "fail" or entry.comparison is None:
                continue
            try:
                e = stale_metadata(read_capture(before), read_capture(path), opts)
            except Exception:  # an aid: never the replay's cost
                continue
            if e is not None:
                old = entry.explanation
                if old is not None:
                    e.other_causes.append(Alternative(old.hypothesis, old.detail, old.request, old.residual_ratio))
                entry.explanation = e


def stale_metadata(prev: Capture, cap: Capture, opts: ReplayOptions) -> Optional[Explanation]:
    """``stale_metadata {"step"}``: ``cap``'s observed output is the attention under ``prev``'s
    metadata (decode, the same batch size, every slot prev attends present in cap's pool), or None.
    A block-table capture (vLLM) is judged the same way: the rows prev's table and lengths name, by
    their physical slots, read as a token list (a stale table is a stale row list)."""
    if not (prev.is_decode and cap.is_decode) or prev.batch_size != cap.batch_size:
        return None
    if prev.meta.page_size != cap.meta.page_size:
        return None
    phys = lambda c: (c.orig_kv_indices if c.orig_kv_indices is not None else c.kv_indices).long()  # noqa: E731
    row_of = dict(zip(phys(cap).tolist(), cap.kv_indices.long().tolist()))
    want = phys(prev).tolist()
    if any(x not in row_of for x in want):
        return None
    rows = torch.tensor([row_of[x] for x in want], dtype=cap.kv_indices.dtype)
    stale = dataclasses.replace(cap, kv_indptr=prev.kv_indptr, kv_indices=rows, seq_lens=prev.seq_lens,
                                num_kv_splits=prev.num_kv_splits, orig_kv_indices=None, block_table=None,
                                attn_logits=None, attn_lse=None)  # fmt: skip
    with single_thread():
        ctx = ReplayContext(stale, dataclasses.replace(opts, explain=False))
        cmp = ctx.compare("observed", cap.out)
    if not cmp.passed:
        return None
    ratio = cmp.row_err / cmp.row_tol if cmp.row_err is not None else None
    changed = [b for b in range(cap.batch_size) if int(prev.seq_lens[b]) != int(cap.seq_lens[b])]
    return Explanation(
        hypothesis="stale_metadata", request=None, detail={"step": prev.meta.step},
        max_abs_err=cmp.max_abs_err, residual_ratio=float(ratio.max()) if ratio is not None and ratio.numel() else 0.0,
        extra={"scope": "all requests", "previous": prev.path, "seq_lens_used": prev.seq_lens.tolist(),
               "requests_changed": changed,
               "why": f"the output is the attention under step {prev.meta.step}'s metadata (indptr, indices, "
                      f"seq_lens, num_kv_splits): a graph replayed with the previous step's metadata"},
    )  # fmt: skip


def pair_steps(prev: Capture, nxt: Capture) -> tuple[str, list[tuple[int, int]]]:
    """("rid" | "order", [(request in prev, request in nxt)])."""
    if prev.meta.rids is not None and nxt.meta.rids is not None:
        where = {}
        for b, rid in enumerate(prev.meta.rids[: prev.batch_size]):
            where.setdefault(rid, b)
        return "rid", [(where[rid], b) for b, rid in enumerate(nxt.meta.rids[: nxt.batch_size]) if rid in where]
    return "order", [(b, b) for b in range(min(prev.batch_size, nxt.batch_size))]


def compare_steps(prev: Capture, nxt: Capture) -> list[Finding]:
    """Findings for ``nxt`` against the previous capture of its series."""
    s0, s1 = prev.meta.step, nxt.meta.step
    dstep = s1 - s0 if s0 is not None and s1 is not None else 1
    base = {"previous": prev.path, "step": s1, "previous_step": s0}

    def finding(check: str, severity: str, message: str, b=None, **numbers) -> Finding:
        return Finding(check, severity, message, request=b, rid=nxt.rid(b), numbers={**base, **numbers})

    if dstep <= 0:
        return [finding("series_step", "note", f"step {s1} follows step {s0} ({prev.path}); not compared")]
    how, pairs = pair_steps(prev, nxt)
    findings: list[Finding] = []
    if how == "order" and prev.batch_size != nxt.batch_size:
        findings.append(finding("series_pairing", "note", f"no rids: requests paired by order, but the batch has "
                                f"{prev.batch_size} then {nxt.batch_size} requests"))  # fmt: skip
    for bp, bn in pairs:
        L0, L1 = int(prev.seq_lens[bp]), int(nxt.seq_lens[bn])
        grow = dstep if nxt.is_decode else int(nxt.qo_indptr[bn + 1] - nxt.qo_indptr[bn])
        if L1 - L0 != grow:
            message = f"{nxt.label(bn)}: seq_len {L0} at step {s0} -> {L1} at step {s1} ({L1 - L0:+d}, expected {grow:+d})"
            findings.append(finding("seq_len_step", "warning", message, bn, previous_request=bp, seq_len=L1,
                                    previous_seq_len=L0, delta=L1 - L0, expected_delta=grow))  # fmt: skip
    if not pairs or prev.kv_buffer.shape[-1] != nxt.kv_buffer.shape[-1]:
        return findings
    for bp, bn, pos, n in changed_positions(prev, nxt, pairs):
        message = (f"{nxt.label(bn)}: {int(pos.numel())} of {n} earlier positions hold other KV bytes than at "
                   f"step {s0}, first position {int(pos[0])}")  # fmt: skip
        pages = torch.unique(pos // nxt.meta.page_size).tolist()[:64]
        findings.append(finding("kv_rows_changed", "warning", message, bn, previous_request=bp,
                                count=int(pos.numel()), first_position=int(pos[0]), pages=pages))  # fmt: skip
    return findings


def changed_positions(prev: Capture, nxt: Capture, pairs: list[tuple[int, int]]):
    """(request in prev, request in nxt, changed positions, positions compared) for every pair whose
    rows at positions < min(seq_len) hold other bytes in ``nxt`` than in ``prev``."""
    pp, pn = prev.kv_indptr.long(), nxt.kv_indptr.long()
    rows_p, rows_n, counts = [], [], []
    for bp, bn in pairs:
        n = min(int(prev.seq_lens[bp]), int(nxt.seq_lens[bn]))
        rows_p.append(prev.kv_indices.long()[int(pp[bp]) : int(pp[bp]) + n])
        rows_n.append(nxt.kv_indices.long()[int(pn[bn]) : int(pn[bn]) + n])
        counts.append(n)
    changed = rows_differ(prev.kv_buffer, torch.cat(rows_p), nxt.kv_buffer, torch.cat(rows_n))
    off = 0
    for (bp, bn), n in zip(pairs, counts):
        c = changed[off : off + n]
        off += n
        if bool(c.any()):
            yield bp, bn, torch.nonzero(c).flatten(), n
