"""Transfer fidelity: the KV rows of one request, prefill side vs decode side (CONTRACT section 3).

With prefill/decode disaggregation the prefill node writes a prompt's latent KV rows into its
pool and a transfer engine (MORI over RDMA on MI355X) copies them into the decode node's pool,
usually at other slots. Position ``j`` of a request is the row ``kv_indices[kv_indptr[b] + j]``
on either side, so the two captures can be compared position by position, bit for bit:

    pair requests        by rid (meta ``rids``) when every capture has them, else by order
    owner of position j  the prefill capture whose new tokens include j (chunked prefill: each
                         chunk's extend capture covers the whole sequence after its write), else
                         the last capture that covers j
    compare              every position both sides hold; the decode side may hold more
    report               per request: positions compared, mismatched, first mismatch, mismatched
                         pages (decode page_size), max abs difference, row norms of both sides
    transfer runs        with physical slots on both sides (``orig_kv_indices``): maximal runs of
                         positions contiguous in both pools -- what one RDMA write moves -- that
                         hold mismatches, with a detected position offset or not-landed (zero) rows

Comparing reads each attended row of both pools once more (gathered in chunks as 64-bit words),
so it costs about as much as reading the two files (``tools/bench_diffkv.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import numpy as np
import torch

from refmla.capture import Capture, CaptureError, read_capture
from refmla.pool import row_stats, row_words, rows_differ
from refmla.util import single_thread

MAX_RANGES = 64  # mismatch ranges / transfer runs listed per request
MAX_OFFSET_SEARCH = 16  # mismatched runs per request searched for a position offset


def diff_kv_files(prefill_paths: Union[str, Sequence[str]], decode_path: str, plot_dir: Optional[str] = None) -> dict:
    """Read the captures and compare their KV rows (see the module docstring).

    Raises CaptureError for a file that cannot be read or captures that cannot be compared
    (different row widths, no request in common). With ``plot_dir``, also draws the mismatches
    (needs matplotlib; ImportError otherwise, raised before anything is read).
    """
    if plot_dir is not None:
        from refmla import plots  # fail before the work when matplotlib is missing
    if isinstance(prefill_paths, (str, Path)):
        prefill_paths = [prefill_paths]
    if not prefill_paths:
        raise CaptureError("<prefill>", "arguments", "at least one prefill capture is needed")
    with single_thread():
        prefill = [read_capture(p) for p in prefill_paths]
        decode = read_capture(decode_path)
        result = diff_kv(prefill, decode)
    if plot_dir is not None:
        result["plots"] = [str(p) for p in plots.plot_diff_kv(result, plot_dir)]
    return result


# --------------------------------------------------------------------------------------------
# Pairing requests and owning positions
# --------------------------------------------------------------------------------------------


@dataclass
class _Source:
    """One prefill capture's view of one request."""

    cap: int  # index into the prefill captures
    b: int  # request index in that capture
    length: int  # positions it holds (its seq_len)
    new: tuple  # [lo, hi) positions it wrote (extend: its new tokens; decode: the last one)


@dataclass
class _Request:
    label: Any  # rid, or the index when pairing by order
    rid: Optional[str]
    decode_b: Optional[int]
    sources: list = field(default_factory=list)  # [_Source]


def _new_range(cap: Capture, b: int) -> tuple[int, int]:
    L = int(cap.seq_lens[b])
    if cap.is_decode:
        return (max(L - 1, 0), L)
    n = int(cap.qo_indptr[b + 1] - cap.qo_indptr[b])
    return (L - n, L)


def pair_requests(prefill: list[Capture], decode: Capture) -> tuple[str, list[_Request], list[str]]:
    """("rid" | "order", requests in decode order then prefill-only ones, notes)."""
    notes: list[str] = []
    by_rid = decode.meta.rids is not None and all(c.meta.rids is not None for c in prefill)
    reqs: dict[Any, _Request] = {}
    if by_rid:
        for b, rid in enumerate(decode.meta.rids[: decode.batch_size]):
            if rid in reqs:
                notes.append(f"decode capture lists rid {rid} twice; request {b} ignored")
                continue
            reqs[rid] = _Request(rid, rid, b)
        for ci, c in enumerate(prefill):
            seen = set()
            for b, rid in enumerate(c.meta.rids[: c.batch_size]):
                if rid in seen:
                    notes.append(f"{c.path} lists rid {rid} twice; request {b} ignored")
                    continue
                seen.add(rid)
                reqs.setdefault(rid, _Request(rid, rid, None)).sources.append(
                    _Source(ci, b, int(c.seq_lens[b]), _new_range(c, b))
                )
    else:
        missing = [c.path for c in [*prefill, decode] if c.meta.rids is None]
        notes.append(f"paired by order: no rids in {', '.join(missing)}")
        sizes = {c.path: c.batch_size for c in [*prefill, decode]}
        if len(set(sizes.values())) > 1:
            notes.append(
                "batch sizes differ ("
                + ", ".join(f"{p}: {n}" for p, n in sizes.items())
                + "); pairing by order is a guess"
            )
        for b in range(max(sizes.values())):
            rid = decode.meta.rids[b] if decode.meta.rids is not None and b < decode.batch_size else None
            r = _Request(b, rid, b if b < decode.batch_size else None)
            for ci, c in enumerate(prefill):
                if b < c.batch_size:
                    r.sources.append(_Source(ci, b, int(c.seq_lens[b]), _new_range(c, b)))
            reqs[b] = r
    return ("rid" if by_rid else "order"), list(reqs.values()), notes


def _owners(sources: list[_Source]) -> torch.Tensor:
    """owner [Lmax]: which source supplies position j (index into sources)."""
    Lmax = max(s.length for s in sources)
    owner = torch.full((Lmax,), -1, dtype=torch.int64)
    for i, s in enumerate(sources):  # the last capture that covers j ...
        owner[: s.length] = i
    for i, s in enumerate(sources):  # ... unless one wrote j (the last one that did)
        lo, hi = s.new
        owner[lo:hi] = i
    return owner


def _ranges(pos: torch.Tensor) -> list[list[int]]:
    """Sorted positions -> [[start, end), ...] runs of consecutive ones."""
    if pos.numel() == 0:
        return []
    brk = torch.nonzero(pos[1:] != pos[:-1] + 1).flatten() + 1
    starts = torch.cat([pos[:1], pos[brk]])
    ends = torch.cat([pos[brk - 1], pos[-1:]]) + 1
    return [[int(a), int(b)] for a, b in zip(starts, ends)]


# --------------------------------------------------------------------------------------------
# The comparison
# --------------------------------------------------------------------------------------------


def diff_kv(prefill: list[Capture], decode: Capture) -> dict:
    """Compare already read captures; the result of :func:`diff_kv_files` without plots.

    Runs with one torch thread: the bulk is memcmp / numpy (single-threaded anyway), the rest
    thousands of small index operations, for which intra-op threads only add barrier waits
    (20 ms each on a loaded machine).
    """
    with single_thread():
        return _diff_kv(prefill, decode)


def _diff_kv(prefill: list[Capture], decode: Capture) -> dict:
    D = decode.kv_buffer.shape[-1]
    notes: list[str] = []
    for c in prefill:
        if c.kv_buffer.shape[-1] != D:
            raise CaptureError(
                decode.path,
                "tensor 'kv_buffer'",
                f"rows of {D} elements but prefill capture {c.path} has {c.kv_buffer.shape[-1]}",
            )
        if c.kv_buffer.dtype != decode.kv_buffer.dtype:
            notes.append(
                f"{c.path} stores {_dt(c.kv_buffer.dtype)} and the decode capture {_dt(decode.kv_buffer.dtype)}: "
                "rows compared by value, not bit for bit"
            )
    pairing, reqs, pair_notes = pair_requests(prefill, decode)
    notes += pair_notes
    paired = [r for r in reqs if r.decode_b is not None and r.sources]
    if not paired:
        what = "rid" if pairing == "rid" else "request index"
        raise CaptureError(decode.path, "meta key 'rids'" if pairing == "rid" else "tensor 'kv_indptr'",
                           f"no {what} in common with the prefill capture(s); nothing to compare")  # fmt: skip
    P = decode.meta.page_size
    d_idx, d_ptr = decode.kv_indices, decode.kv_indptr.long()

    # 1. every compared position as (owner capture, prefill row, decode row), grouped by owner
    plan = []  # per paired request: (request, n, owner [n], offset into the flat arrays)
    per_cap: dict[int, list] = {}  # capture -> [(flat positions, prefill rows, decode rows)]
    total = 0
    for r in paired:
        Ld = int(decode.seq_lens[r.decode_b])
        owner = _owners(r.sources)
        n = min(owner.numel(), Ld)
        owner = owner[:n]
        plan.append((r, n, owner, total))
        d_rows = d_idx[int(d_ptr[r.decode_b]) : int(d_ptr[r.decode_b]) + n].long()  # [n]
        for i, s in enumerate(r.sources):
            js = torch.nonzero(owner == i).flatten()
            if js.numel() == 0:
                continue
            c = prefill[s.cap]
            p_rows = c.kv_indices[int(c.kv_indptr[s.b]) + js].long()
            per_cap.setdefault(s.cap, []).append((total + js, p_rows, d_rows[js]))
        total += n

    # 2. compare bit for bit (rows_differ: memcmp per run contiguous in both pools, else chunked gathers)
    mism = torch.zeros(total, dtype=torch.bool)
    p_row_of = torch.full((total,), -1, dtype=torch.int64)  # prefill row of each flat position
    p_cap_of = torch.full((total,), -1, dtype=torch.int64)
    d_row_of = torch.full((total,), -1, dtype=torch.int64)
    for ci, parts in per_cap.items():
        flat = torch.cat([p[0] for p in parts])
        pr, dr = torch.cat([p[1] for p in parts]), torch.cat([p[2] for p in parts])
        mism[flat] = rows_differ(prefill[ci].kv_buffer, pr, decode.kv_buffer, dr)
        p_row_of[flat], p_cap_of[flat], d_row_of[flat] = pr, ci, dr

    # 3. the numbers of the mismatched rows
    bad = torch.nonzero(mism).flatten()
    stats = {}
    if bad.numel():
        stats = {k: torch.empty(bad.numel(), dtype=v) for k, v in (
            ("max_abs_diff", torch.float64), ("norm_a", torch.float64), ("norm_b", torch.float64),
            ("differing_dims", torch.int64), ("nonfinite_a", torch.int64), ("nonfinite_b", torch.int64),
            ("zero_a", torch.bool), ("zero_b", torch.bool))}  # fmt: skip
        for ci in per_cap:
            sel = torch.nonzero(p_cap_of[bad] == ci).flatten()
            if sel.numel():
                st = row_stats(prefill[ci].kv_buffer, p_row_of[bad[sel]], decode.kv_buffer, d_row_of[bad[sel]])
                for k, v in st.items():
                    stats[k][sel] = v

    # 4. per request
    phys = decode.orig_kv_indices is not None and all(c.orig_kv_indices is not None for c in prefill)
    entries = []
    for r, n, owner, off in plan:
        entries.append(_request_entry(r, n, owner, off, prefill, decode, mism, bad, stats, P, phys))
    for r in reqs:
        if r.decode_b is None or not r.sources:
            side = "prefill_only" if r.decode_b is None else "decode_only"
            entries.append({
                "request": r.label, "rid": r.rid, "status": side, "positions_compared": 0,
                "mismatched_positions": 0, "first_mismatch": None, "mismatched_pages": [],
                "note": "only in the prefill capture(s)" if side == "prefill_only" else "only in the decode capture",
            })  # fmt: skip
    mismatched = int(mism.sum())
    bad_reqs = sum(1 for e in entries if e["mismatched_positions"])
    result = {
        "ok": mismatched == 0,
        "requests": entries,
        "prefill": [c.path for c in prefill],
        "decode": decode.path,
        "pairing": pairing,
        "page_size": P,
        "compared": "bytes" if all(c.kv_buffer.dtype == decode.kv_buffer.dtype for c in prefill) else "values",
        "physical_slots": phys,
        "positions_compared": total,
        "mismatched_positions": mismatched,
        "mismatched_requests": bad_reqs,
        "paired_requests": len(paired),
        "prefill_only": [r.label for r in reqs if r.decode_b is None],
        "decode_only": [r.label for r in reqs if r.decode_b is not None and not r.sources],
        "notes": notes,
    }
    if not phys:
        result["notes"].append("no orig_kv_indices on both sides: mismatches are not grouped into transfer runs")
    return result


def _request_entry(r, n, owner, off, prefill, decode, mism, bad, stats, P, phys) -> dict:
    m = mism[off : off + n]
    pos = torch.nonzero(m).flatten()  # [k] mismatched positions of this request
    e: dict[str, Any] = {
        "request": r.label,
        "rid": r.rid,
        "status": "mismatch" if pos.numel() else "match",
        "positions_compared": n,
        "mismatched_positions": int(pos.numel()),
        "first_mismatch": int(pos[0]) if pos.numel() else None,
        "mismatched_pages": torch.unique(pos // P).tolist(),
        "positions_prefill": max(s.length for s in r.sources),
        "positions_decode": int(decode.seq_lens[r.decode_b]),
        "prefill_captures": sorted({s.cap for s in r.sources}),
    }
    if e["positions_decode"] < e["positions_prefill"]:
        e["note"] = (f"the decode side holds {e['positions_decode']} positions, fewer than the prefill side's "
                     f"{e['positions_prefill']}")  # fmt: skip
    if len(r.sources) > 1:
        e["prefill_disagreements"] = _prefill_self_check(r, prefill)
    if not pos.numel():
        return e
    k0 = int(torch.searchsorted(bad, torch.tensor(off)))
    st = {k: v[k0 : k0 + pos.numel()] for k, v in stats.items()}  # stats of this request's mismatches
    ranges = _ranges(pos)
    e["mismatch_ranges"] = ranges[:MAX_RANGES]
    if len(ranges) > MAX_RANGES:
        e["mismatch_ranges_total"] = len(ranges)
    e["max_abs_diff"] = float(st["max_abs_diff"].max())
    e["decode_zero_rows"] = int(st["zero_b"].sum())
    e["prefill_zero_rows"] = int(st["zero_a"].sum())
    e["nonfinite_rows"] = {"prefill": int((st["nonfinite_a"] > 0).sum()), "decode": int((st["nonfinite_b"] > 0).sum())}
    w = int(st["max_abs_diff"].argmax())
    e["first_detail"] = _detail(0, pos, st, off, prefill, decode, r)
    e["worst_detail"] = _detail(w, pos, st, off, prefill, decode, r)
    e["summary"] = _summary(e, st)
    if phys:
        e["transfer_runs"] = _transfer_runs(r, n, owner, m, prefill, decode, P)
        runs = e["transfer_runs"]
        if runs["with_mismatches"] == 1 and runs["mismatched"][0].get("offset") is not None:
            k = runs["mismatched"][0]["offset"]
            e["summary"] += f"; one transfer run, rows shifted by {k} position{'s' if abs(k) != 1 else ''}"
        elif runs["with_mismatches"] == 1:
            e["summary"] += "; all in one transfer run"
    return e


def _detail(i: int, pos, st, off, prefill, decode, r) -> dict:
    j = int(pos[i])
    d = {
        "position": j,
        "page": j // decode.meta.page_size,
        "max_abs_diff": float(st["max_abs_diff"][i]),
        "prefill_norm": float(st["norm_a"][i]),
        "decode_norm": float(st["norm_b"][i]),
        "differing_dims": int(st["differing_dims"][i]),
    }
    s = r.sources[int(_owners(r.sources)[j])]
    c, at_p, at_d = prefill[s.cap], int(prefill[s.cap].kv_indptr[s.b]) + j, int(decode.kv_indptr[r.decode_b]) + j
    d.update(prefill_capture=s.cap, prefill_row=int(c.kv_indices[at_p]), decode_row=int(decode.kv_indices[at_d]))
    if c.orig_kv_indices is not None:
        d["prefill_slot"] = int(c.orig_kv_indices[at_p])
    if decode.orig_kv_indices is not None:
        d["decode_slot"] = int(decode.orig_kv_indices[at_d])
    return d


def _summary(e: dict, st: dict) -> str:
    k = e["mismatched_positions"]
    if e["decode_zero_rows"] == k:
        return "every mismatched decode row is all zero (not landed)"
    if int((st["nonfinite_b"] > 0).sum()) == k:
        return "every mismatched decode row holds NaN/Inf"
    if e["prefill_zero_rows"] == k:
        return "every mismatched prefill row is all zero"
    return f"rows differ (max abs diff {e['max_abs_diff']:.3g})"


def _prefill_self_check(r: _Request, prefill: list[Capture]) -> dict:
    """Chunk captures that hold the same position must hold the same bytes there."""
    owner = _owners(r.sources)
    count, first = 0, None
    for i, s in enumerate(r.sources):
        js = torch.nonzero(owner[: s.length] != i).flatten()
        if js.numel() == 0:
            continue
        c = prefill[s.cap]
        rows_s = c.kv_indices[int(c.kv_indptr[s.b]) + js].long()
        for o in torch.unique(owner[js]).tolist():
            sel = owner[js] == o
            so = r.sources[o]
            co = prefill[so.cap]
            rows_o = co.kv_indices[int(co.kv_indptr[so.b]) + js[sel]].long()
            diff = rows_differ(c.kv_buffer, rows_s[sel], co.kv_buffer, rows_o)
            if bool(diff.any()):
                count += int(diff.sum())
                j = int(js[sel][diff][0])
                first = j if first is None else min(first, j)
    return {"positions": count, "first": first}


def _transfer_runs(r, n, owner, m, prefill, decode, P) -> dict:
    """Maximal runs of positions contiguous in both pools' physical slots (one transfer write each)."""
    phys_p = torch.empty(n, dtype=torch.int64)
    for i, s in enumerate(r.sources):
        js = torch.nonzero(owner == i).flatten()
        c = prefill[s.cap]
        phys_p[js] = c.orig_kv_indices[int(c.kv_indptr[s.b]) + js].long()
    d0 = int(decode.kv_indptr[r.decode_b])
    phys_d = decode.orig_kv_indices[d0 : d0 + n].long()
    cont = (phys_p[1:] == phys_p[:-1] + 1) & (phys_d[1:] == phys_d[:-1] + 1) & (owner[1:] == owner[:-1])
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), torch.nonzero(~cont).flatten() + 1])
    ends = torch.cat([starts[1:], torch.tensor([n])])
    c = torch.zeros(n + 1, dtype=torch.int64)
    c[1:] = torch.cumsum(m.long(), 0)
    k = c[ends] - c[starts]  # mismatches per run
    out = []
    for ri in torch.nonzero(k).flatten().tolist():
        a, b = int(starts[ri]), int(ends[ri])
        first = a + int(torch.nonzero(m[a:b])[0])
        run = {
            "start": a, "end": b, "positions": b - a, "mismatched_positions": int(k[ri]),
            "first_mismatch": first, "pages": [a // P, (b - 1) // P],
            "prefill_slot": int(phys_p[a]), "decode_slot": int(phys_d[a]),
        }  # fmt: skip
        if len(out) < MAX_OFFSET_SEARCH:
            run["offset"] = _offset(r, owner, a, b, m, prefill, decode)
            run["decode_zero_rows"] = _zero_rows(decode, r.decode_b, a, b, m)
        out.append(run)
        if len(out) >= MAX_RANGES:
            break
    return {"runs": int(starts.numel()), "with_mismatches": int((k > 0).sum()), "mismatched": out}


def _zero_rows(decode: Capture, b: int, a: int, e: int, m: torch.Tensor) -> int:
    js = torch.nonzero(m[a:e]).flatten() + a
    rows = decode.kv_indices[int(decode.kv_indptr[b]) + js].long()
    return int((row_words(decode.kv_buffer).index_select(0, rows) == 0).all(1).sum())


def _offset(r, owner, a, b, m, prefill, decode) -> Optional[int]:
    """k != 0 such that every mismatched decode row j in [a, b) equals the prefill row j + k, else None."""
    s = r.sources[int(owner[a])]
    c = prefill[s.cap]
    if c.kv_buffer.dtype != decode.kv_buffer.dtype:
        return None
    p_rows = c.kv_indices[int(c.kv_indptr[s.b]) : int(c.kv_indptr[s.b]) + s.length].long()  # [Lp]
    wp, wd = row_words(c.kv_buffer), row_words(decode.kv_buffer)
    js = torch.nonzero(m[a:b]).flatten() + a  # mismatched positions of the run
    d_rows = decode.kv_indices[int(decode.kv_indptr[r.decode_b]) + js].long()
    target = wd[d_rows[0]]  # [W] the run's first mismatched decode row
    hits = torch.nonzero((wp.index_select(0, p_rows) == target).all(1)).flatten() - int(js[0])
    hits = hits[hits != 0]
    if hits.numel() == 0 or bool((wd[d_rows[0]] == 0).all()):
        return None
    for k in sorted(hits.tolist(), key=abs)[:4]:
        src = js + k
        if bool(((src < 0) | (src >= s.length)).any()):
            continue
        if not bool(rows_differ(c.kv_buffer, p_rows[src], decode.kv_buffer, d_rows).any()):
            return int(k)
    return None


def _dt(d: torch.dtype) -> str:
    return str(d).replace("torch.", "")


# --------------------------------------------------------------------------------------------
# Text
# --------------------------------------------------------------------------------------------


def _pages_text(pages: list[int], limit: int = 8) -> str:
    if not pages:
        return "-"
    runs = _ranges(torch.tensor(pages))
    parts = [f"{a}" if b == a + 1 else f"{a}-{b - 1}" for a, b in runs]
    return ",".join(parts[:limit]) + (f",... ({len(pages)} pages)" if len(parts) > limit else "")


def render_diff(result: dict) -> str:
    """The diff-kv result as a table, the transfer runs holding mismatches, and a verdict line."""
    from refmla.render.table import table

    pre = result["prefill"]
    head = [
        f"prefill  {pre[0]}" + (f" (+{len(pre) - 1} chunk capture(s): {', '.join(pre[1:])})" if len(pre) > 1 else ""),
        f"decode   {result['decode']}",
        f"paired by {result['pairing']}, pages of {result['page_size']} (decode side), compared {result['compared']}",
    ]
    head += [f"note     {n}" for n in result["notes"]]
    rows = []
    for e in result["requests"]:
        note = e.get("summary") or e.get("note") or ("" if e["status"] in ("match",) else e["status"])
        if e.get("prefill_disagreements", {}).get("positions"):
            pdis = e["prefill_disagreements"]
            note += f" | prefill chunks disagree at {pdis['positions']} positions (first {pdis['first']})"
        fd = e.get("first_detail")
        norms = f"{fd['prefill_norm']:.4g} / {fd['decode_norm']:.4g}" if fd else "-"
        rows.append(
            [
                str(e["request"]),
                str(e["positions_compared"]),
                str(e["mismatched_positions"]),
                "-" if e["first_mismatch"] is None else str(e["first_mismatch"]),
                _pages_text(e["mismatched_pages"]),
                f"{e['max_abs_diff']:.3g}" if e.get("max_abs_diff") is not None else "-",
                norms,
                note,
            ]
        )
    body = table(
        rows, ["request", "compared", "mismatched", "first", "pages", "max_abs_diff", "norms p/d @first", "note"]
    )
    lines = [*head, "", body]
    runs = [
        (e["request"], run) for e in result["requests"] for run in (e.get("transfer_runs") or {}).get("mismatched", [])
    ]
    if runs:
        lines += ["", "transfer runs (contiguous on both sides) holding mismatches:"]
        for req, run in runs[:32]:
            extra = ""
            if run.get("offset") is not None:
                extra = f", decode rows are the prefill rows shifted by {run['offset']}"
            elif run.get("decode_zero_rows"):
                extra = f", {run['decode_zero_rows']} decode rows all zero"
            lines.append(
                f"  {req}: positions [{run['start']}, {run['end']}) pages {run['pages'][0]}-{run['pages'][1]} "
                f"prefill slot {run['prefill_slot']} -> decode slot {run['decode_slot']}: "
                f"{run['mismatched_positions']} of {run['positions']} mismatched{extra}"
            )
        if len(runs) > 32:
            lines.append(f"  ... {len(runs) - 32} more")
    lines.append("")
    if result["ok"]:
        lines.append(f"verdict  match: {result['positions_compared']} positions of {result['paired_requests']} "
                     "request(s) identical")  # fmt: skip
    else:
        lines.append(f"verdict  MISMATCH: {result['mismatched_positions']} of {result['positions_compared']} positions "
                     f"in {result['mismatched_requests']} of {result['paired_requests']} request(s)")  # fmt: skip
    if result["prefill_only"] or result["decode_only"]:
        lines.append(f"unpaired {len(result['prefill_only'])} request(s) only on the prefill side, "
                     f"{len(result['decode_only'])} only on the decode side")  # fmt: skip
    return "\n".join(lines)
