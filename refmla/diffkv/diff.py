"""The diff itself: plan the compared positions, compare their rows bit for bit, build each request's entry.

    plan       every position both sides hold (the decode side may hold more; a sparse cache's
               position listed -1 is not held, refmla.diffkv.views), as (owner capture, prefill row,
               decode row), grouped by owner capture
    compare    ``rows_differ`` per owner capture: memcmp per run contiguous in both pools, else
               chunked gathers; then ``row_stats`` of the mismatched rows only (a sparse cache's:
               of their decoded values, and which packed sections differ)
    encoding   fp8 rows that differ in value but not in bytes: the sides' encodings differ
               (``kv_fp8_encoding_mismatch`` in the result's notes)
    per request  positions compared, mismatched, first mismatch, mismatched pages (decode
               page_size), max abs difference, row norms of both sides, transfer runs (``runs``)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from refmla.capture import Capture, CaptureError
from refmla.diffkv.pairing import PairedRequest, Pairing, pair_requests
from refmla.diffkv.provenance import RowIndex, sources_of
from refmla.diffkv.runs import MAX_RANGES, ranges, transfer_runs
from refmla.diffkv.tokens import TokenPaired, pair_by_tokens, reuse_of, tokens_known
from refmla.diffkv.result import DiffResult, MismatchDetail, Mismatches, PrefillDisagreement, RequestDiff
from refmla.diffkv.views import SECTION_BITS, SECTION_TEXT
from refmla.pool import row_stats, rows_differ, value_stats
from refmla.util import dtype_name, single_thread


def diff_kv(prefill: list[Capture], decode: Capture) -> DiffResult:
    """Compare already read captures: the prefill capture(s) of some requests (several: chunked
    prefill) against one decode capture. Each request's typed entry is in ``.requests``.

    Runs with one torch thread: the bulk is memcmp / numpy (single-threaded anyway), the rest
    thousands of small index operations, for which intra-op threads only add barrier waits
    (20 ms each on a loaded machine).
    """
    with single_thread():
        notes = _check_rows(prefill, decode)
        pairing = pair_by_tokens(prefill, decode) if tokens_known(prefill, decode) else pair_requests(prefill, decode)
        plan = _plan(pairing, prefill, decode)
        cmp = _compare(plan, prefill, decode)
        phys = decode.orig_kv_indices is not None and all(c.orig_kv_indices is not None for c in prefill)
        index = _LazyIndex(prefill)
        entries = [_request_diff(p, cmp, prefill, decode, phys, index) for p in plan.requests]
        entries += [_unpaired(r) for r in pairing.requests if not r.paired]
        notes += encoding_notes(cmp, prefill, decode)
        return _result(entries, pairing, prefill, decode, phys, notes + pairing.notes, plan.compared)


def encoding_notes(cmp: "_Compared", prefill: list[Capture], decode: Capture) -> list[str]:
    """``kv_fp8_encoding_mismatch`` where a prefill capture's fp8 dtype is not the decode's and every
    row that differs in value holds the same bytes on both sides: the transfer copied the bytes
    intact, the two sides read them in other encodings (written = the prefill's, read = the decode's)."""
    d, out = decode.kv_buffer, []
    for ci, c in enumerate(prefill):
        if c.kv_buffer.dtype == d.dtype or c.kv_buffer.dtype.itemsize != 1 or d.dtype.itemsize != 1:
            continue
        sel = cmp.bad[cmp.p_cap[cmp.bad] == ci]
        if not sel.numel():
            continue
        a = c.kv_buffer[cmp.p_row[sel]].contiguous().view(torch.uint8).reshape(sel.numel(), -1)
        b = d[cmp.d_row[sel]].contiguous().view(torch.uint8).reshape(sel.numel(), -1)
        if bool((a == b).all()):
            out.append(f"kv_fp8_encoding_mismatch(written={dtype_name(c.kv_buffer.dtype)}, read={dtype_name(d.dtype)}): "
                       f"the {sel.numel()} row(s) of {c.path} that differ in value hold the same bytes on both sides: "
                       f"the transfer copied them intact, the two sides read them in other fp8 encodings")  # fmt: skip
    return out


# --------------------------------------------------------------------------------------------
# Planning and comparing
# --------------------------------------------------------------------------------------------


@dataclass
class _Planned:
    req: PairedRequest
    n: int  # positions [0, n) of the request in the flat arrays
    off: int  # where they start in the flat arrays
    held: torch.Tensor  # [n] bool: the position is held by both sides (compared)


@dataclass
class _Plan:
    requests: list[_Planned]
    per_cap: dict[int, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]  # capture -> [(flat, p rows, d rows)]
    total: int  # positions of all requests in the flat arrays
    compared: int = 0  # of them held by both sides


@dataclass
class _Compared:
    """Every compared position, flat (requests one after the other in plan order)."""

    mism: torch.Tensor  # [total] bool: the two rows differ
    p_cap: torch.Tensor  # [total] owner capture of each position
    p_row: torch.Tensor  # [total] its prefill pool row
    d_row: torch.Tensor  # [total] its decode pool row
    bad: torch.Tensor  # [K] sorted flat indices of the mismatches
    stats: dict[str, torch.Tensor]  # row_stats of the mismatched rows, [K] each

    def stats_of(self, off: int, k: int) -> dict[str, torch.Tensor]:
        """The stats of the ``k`` mismatches from flat position ``off`` on (one request's)."""
        k0 = int(torch.searchsorted(self.bad, torch.tensor(off)))
        return {name: v[k0 : k0 + k] for name, v in self.stats.items()}


def _check_rows(prefill: list[Capture], decode: Capture) -> list[str]:
    """Rows of one width on both sides (else CaptureError); a note per prefill capture of another dtype."""
    D, notes = decode.kv_buffer.shape[-1], []
    for c in prefill:
        if c.kv_buffer.shape[-1] != D:
            what = f"rows of {D} elements but prefill capture {c.path} has {c.kv_buffer.shape[-1]}"
            raise CaptureError(decode.path, "tensor 'kv_buffer'", what)
        if c.kv_buffer.dtype != decode.kv_buffer.dtype:
            notes.append(f"{c.path} stores {dtype_name(c.kv_buffer.dtype)} and the decode capture "
                         f"{dtype_name(decode.kv_buffer.dtype)}: rows compared by value, not bit for bit")  # fmt: skip
    return notes


def _plan(pairing: Pairing, prefill: list[Capture], decode: Capture) -> _Plan:
    """Every compared position as (owner capture, prefill row, decode row), grouped by owner."""
    paired = pairing.paired
    if not paired:
        by_rid = pairing.by == "rid"
        raise CaptureError(decode.path, "meta key 'rids'" if by_rid else "tensor 'kv_indptr'",
                           f"no {'rid' if by_rid else 'request index'} in common with the prefill capture(s); "
                           "nothing to compare")  # fmt: skip
    plan = _Plan([], {}, 0)
    for r in paired:
        owner = r.owner
        n = min(owner.numel(), int(decode.seq_lens[r.decode_b]))
        owner = owner[:n]
        d0 = r.decode_at(decode, 0)
        d_rows = decode.kv_indices[d0 : d0 + n].long()  # [n]
        held = d_rows >= 0  # [n] (a dense capture holds every position)
        for i, s in enumerate(r.sources):
            js = torch.nonzero(owner == i).flatten()
            p_rows = r.prefill_rows(prefill, i, js)
            held[js] &= p_rows >= 0
            keep = held[js]
            if bool(keep.any()):
                plan.per_cap.setdefault(s.cap, []).append((plan.total + js[keep], p_rows[keep], d_rows[js[keep]]))
        plan.requests.append(_Planned(r, n, plan.total, held))
        plan.total += n
    plan.compared = sum(int(p.held.sum()) for p in plan.requests)
    return plan


def _compare(plan: _Plan, prefill: list[Capture], decode: Capture) -> _Compared:
    """Bit for bit per owner capture, then the numbers of the mismatched rows."""
    total = plan.total
    mism = torch.zeros(total, dtype=torch.bool)
    p_cap, p_row, d_row = (torch.full((total,), -1, dtype=torch.int64) for _ in range(3))
    for ci, parts in plan.per_cap.items():
        flat = torch.cat([p[0] for p in parts])
        pr, dr = torch.cat([p[1] for p in parts]), torch.cat([p[2] for p in parts])
        mism[flat] = rows_differ(prefill[ci].kv_buffer, pr, decode.kv_buffer, dr)
        p_row[flat], p_cap[flat], d_row[flat] = pr, ci, dr
    bad = torch.nonzero(mism).flatten()
    stats: dict[str, torch.Tensor] = {}
    for ci in plan.per_cap if bad.numel() else ():
        sel = torch.nonzero(p_cap[bad] == ci).flatten()
        if sel.numel():
            for k, v in _row_stats(prefill[ci], p_row[bad[sel]], decode, d_row[bad[sel]]).items():
                stats.setdefault(k, torch.zeros(bad.numel(), dtype=v.dtype))[sel] = v
    return _Compared(mism, p_cap, p_row, d_row, bad, stats)


def _row_stats(a, rows_a: torch.Tensor, b, rows_b: torch.Tensor) -> dict[str, torch.Tensor]:
    """row_stats of a dense pool's rows; a sparse cache's (refmla.diffkv.views) rows are packed bytes:
    their decoded values' numbers, and ``sections`` (which packed sections differ, a bit mask)."""
    if not hasattr(a, "row_values"):
        return row_stats(a.kv_buffer, rows_a, b.kv_buffer, rows_b)
    return {**value_stats(a.row_values(rows_a), b.row_values(rows_b)), "zero_a": a.zero_rows(rows_a),
            "zero_b": b.zero_rows(rows_b), "sections": a.sections_differ(rows_a, b, rows_b)}  # fmt: skip


# --------------------------------------------------------------------------------------------
# Per request
# --------------------------------------------------------------------------------------------


NOTHING_COMPARED = "nothing_compared"  # a paired request of which neither side holds a position both hold


class _LazyIndex:
    """The prefill rows hashed by their bytes (refmla.diffkv.provenance), built at the first mismatch."""

    def __init__(self, prefill: list[Capture]):
        self.prefill, self.index = prefill, None

    def get(self) -> RowIndex:
        if self.index is None:
            self.index = RowIndex(self.prefill)
        return self.index


def _request_diff(p: _Planned, cmp: _Compared, prefill: list[Capture], decode: Capture, phys: bool,
                  index: _LazyIndex) -> RequestDiff:  # fmt: skip
    r, n, P = p.req, p.n, decode.meta.page_size
    m = cmp.mism[p.off : p.off + n]
    pos = torch.nonzero(m).flatten()  # [k] mismatched positions of this request
    k, compared = int(pos.numel()), int(p.held.sum())
    status = "mismatch" if k else "match" if compared else NOTHING_COMPARED  # 0 positions is not a match
    e = RequestDiff(request=r.label, rid=r.rid, status=status, positions_compared=compared,
                    mismatched_positions=k, first_mismatch=int(pos[0]) if k else None,
                    mismatched_pages=torch.unique(pos // P).tolist(),
                    positions_prefill=max(s.length for s in r.sources),
                    positions_decode=int(decode.seq_lens[r.decode_b]),
                    prefill_captures=sorted({s.cap for s in r.sources}))  # fmt: skip
    if e.positions_decode < e.positions_prefill:
        e.note = (f"the decode side holds {e.positions_decode} positions, fewer than the prefill side's "
                  f"{e.positions_prefill}")  # fmt: skip
    if len(r.sources) > 1:
        e.prefill_disagreements = _prefill_self_check(r, prefill)
    if isinstance(r, TokenPaired):  # rows paired by the tokens they hold (refmla.diffkv.tokens)
        e.reuse = reuse_of(r, n, p.held, pos, decode, P)
    if not k:
        return e
    e.mismatches = _mismatches(r, pos, cmp.stats_of(p.off, k), prefill, decode)
    if phys:
        e.transfer_runs = transfer_runs(r, n, m, prefill, decode, P, p.held)
    d_rows = decode.kv_indices[r.decode_at(decode, 0) + pos].long()
    e.sources = sources_of(index.get(), decode, d_rows, pos, r.rid)
    if isinstance(r, TokenPaired):  # a reader of the same rows (the request's own later capture) is no source
        e.sources = [src for src in e.sources if not (src.same_request and src.shift == 0)]
    e.summary = _summary(e)
    reused = e.reuse.text(r.label, k) if e.reuse is not None else ""
    e.summary = f"{reused}: {e.summary}" if reused else e.summary
    return e


def _mismatches(r: PairedRequest, pos: torch.Tensor, st: dict, prefill: list[Capture], decode: Capture) -> Mismatches:
    rs = ranges(pos)
    sections = {name: int(((st["sections"] & bit) > 0).sum()) for name, bit in SECTION_BITS.items()} if "sections" in st else None
    return Mismatches(sections=sections,
        ranges=rs[:MAX_RANGES],
        ranges_total=len(rs) if len(rs) > MAX_RANGES else None,
        max_abs_diff=float(st["max_abs_diff"].max()),
        decode_zero_rows=int(st["zero_b"].sum()),
        prefill_zero_rows=int(st["zero_a"].sum()),
        nonfinite_prefill_rows=int((st["nonfinite_a"] > 0).sum()),
        nonfinite_decode_rows=int((st["nonfinite_b"] > 0).sum()),
        first=_detail(0, r, pos, st, prefill, decode),
        worst=_detail(int(st["max_abs_diff"].argmax()), r, pos, st, prefill, decode),
    )


def _detail(
    i: int, r: PairedRequest, pos: torch.Tensor, st: dict, prefill: list[Capture], decode: Capture
) -> MismatchDetail:
    """The ``i``-th mismatch of request ``r``: its numbers, rows and slots."""
    j = int(pos[i])
    s = r.sources[int(r.owner[j])]
    c = prefill[s.cap]
    at_p, at_d = int(c.kv_indptr[s.b]) + j, r.decode_at(decode, j)
    return MismatchDetail(
        position=j,
        page=j // decode.meta.page_size,
        max_abs_diff=float(st["max_abs_diff"][i]),
        prefill_norm=float(st["norm_a"][i]),
        decode_norm=float(st["norm_b"][i]),
        differing_dims=int(st["differing_dims"][i]),
        prefill_capture=s.cap,
        prefill_row=int(c.kv_indices[at_p]),
        decode_row=int(decode.kv_indices[at_d]),
        prefill_slot=int(c.orig_kv_indices[at_p]) if c.orig_kv_indices is not None else None,
        decode_slot=int(decode.orig_kv_indices[at_d]) if decode.orig_kv_indices is not None else None,
    )


def _summary(e: RequestDiff) -> str:
    """One line: what the mismatched rows have in common, and the transfer run when there is one."""
    mm, k = e.mismatches, e.mismatched_positions
    if mm.decode_zero_rows == k:
        text = "every mismatched decode row is all zero (not landed)"
    elif mm.nonfinite_decode_rows == k:
        text = "every mismatched decode row holds NaN/Inf"
    elif mm.prefill_zero_rows == k:
        text = "every mismatched prefill row is all zero"
    else:
        text = f"rows differ (max abs diff {mm.max_abs_diff:.3g})"
        only = [name for name, n in (mm.sections or {}).items() if n]
        if len(only) == 1:  # a packed sparse token: the one section its bytes differ in
            text += f"; only their {SECTION_TEXT[only[0]]} bytes differ"
    runs = e.transfer_runs
    if runs is not None and runs.with_mismatches == 1:
        off = runs.mismatched[0].offset
        if off is not None:
            text += f"; one transfer run, rows shifted by {off} position{'s' if abs(off) != 1 else ''}"
        else:
            text += "; all in one transfer run"
    return text


def _prefill_self_check(r: PairedRequest, prefill: list[Capture]) -> PrefillDisagreement:
    """Chunk captures that hold the same position must hold the same bytes there."""
    owner = r.owner
    count, first = 0, None
    for i, s in enumerate(r.sources):
        js = torch.nonzero(owner[: s.length] != i).flatten()
        if js.numel() == 0:
            continue
        rows_s = r.prefill_rows(prefill, i, js)
        for o in torch.unique(owner[js]).tolist():
            sel = owner[js] == o
            rows_o = r.prefill_rows(prefill, o, js[sel])
            both = (rows_s[sel] >= 0) & (rows_o >= 0)  # a sparse cache's positions not held are not compared
            diff = torch.zeros_like(both)
            diff[both] = rows_differ(prefill[s.cap].kv_buffer, rows_s[sel][both], prefill[r.sources[o].cap].kv_buffer, rows_o[both])
            if bool(diff.any()):
                count += int(diff.sum())
                j = int(js[sel][diff][0])
                first = j if first is None else min(first, j)
    return PrefillDisagreement(count, first)


def _unpaired(r: PairedRequest) -> RequestDiff:
    if r.decode_b is None:
        return RequestDiff(r.label, r.rid, "prefill_only", note="only in the prefill capture(s)")
    if isinstance(r, TokenPaired):
        return RequestDiff(r.label, r.rid, "decode_only", note="no prefill capture holds its tokens (paired by tokens)")
    return RequestDiff(r.label, r.rid, "decode_only", note="only in the decode capture")


def _result(entries: list[RequestDiff], pairing: Pairing, prefill: list[Capture], decode: Capture, phys: bool,
            notes: list[str], total: int) -> DiffResult:  # fmt: skip
    mismatched = sum(e.mismatched_positions for e in entries)
    if not phys:
        notes.append("no orig_kv_indices on both sides: mismatches are not grouped into transfer runs")
    return DiffResult(
        ok=mismatched == 0 and total > 0,
        error=None if total else "nothing compared: no position is held by both sides of any paired request",
        requests=entries,
        prefill=[c.path for c in prefill],
        decode=decode.path,
        pairing=pairing.by,
        page_size=decode.meta.page_size,
        compared="bytes" if all(c.kv_buffer.dtype == decode.kv_buffer.dtype for c in prefill) else "values",
        physical_slots=phys,
        positions_compared=total,
        mismatched_positions=mismatched,
        mismatched_requests=sum(1 for e in entries if e.mismatched_positions),
        paired_requests=len(pairing.paired),
        prefill_only=[r.label for r in pairing.requests if r.decode_b is None],
        decode_only=[r.label for r in pairing.requests if r.decode_b is not None and not r.sources],
        notes=notes,
    )
