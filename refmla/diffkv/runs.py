"""Runs of positions: consecutive mismatched positions, and transfer runs.

A transfer run is a maximal run of a request's positions contiguous in the physical slots
(``orig_kv_indices``) of both pools and owned by one prefill capture: what one RDMA write of the
transfer engine moves. For each run that holds mismatches (the first MAX_OFFSET_SEARCH of a
request) two causes are looked for: a position offset (every mismatched decode row j holds the
prefill row j + k) and rows that did not land (all zero on the decode side).
"""

from __future__ import annotations

from typing import Optional

import torch

from refmla.capture import Capture
from refmla.diffkv.pairing import PairedRequest
from refmla.diffkv.result import TransferRun, TransferRuns
from refmla.pool import row_words, rows_differ

MAX_RANGES = 64  # mismatch ranges / transfer runs listed per request
MAX_OFFSET_SEARCH = 16  # mismatched runs per request searched for a position offset
OFFSETS_TRIED = 4  # candidate offsets (smallest |k| first) verified over a whole run


def ranges(pos: torch.Tensor) -> list[tuple[int, int]]:
    """Sorted positions -> [(start, end), ...] runs of consecutive ones."""
    if pos.numel() == 0:
        return []
    brk = torch.nonzero(pos[1:] != pos[:-1] + 1).flatten() + 1
    starts = torch.cat([pos[:1], pos[brk]])
    ends = torch.cat([pos[brk - 1], pos[-1:]]) + 1
    return [(int(a), int(b)) for a, b in zip(starts, ends)]


def transfer_runs(
    r: PairedRequest, n: int, m: torch.Tensor, prefill: list[Capture], decode: Capture, page_size: int,
    held: Optional[torch.Tensor] = None,
) -> TransferRuns:
    """Request ``r``'s first ``n`` positions cut into transfer runs; ``m`` [n] marks the mismatched ones,
    ``held`` [n] those both sides hold (a sparse cache's others are in no run; None: all)."""
    owner = r.owner[:n]  # [n]
    held = torch.ones(n, dtype=torch.bool) if held is None else held
    phys_p = torch.empty(n, dtype=torch.int64)  # [n] physical slot of each position, prefill side
    for i in range(len(r.sources)):
        js = torch.nonzero(owner == i).flatten()
        phys_p[js] = r.prefill_rows(prefill, i, js, physical=True)
    d0 = r.decode_at(decode, 0)
    phys_d = decode.orig_kv_indices[d0 : d0 + n].long()  # [n]
    cont = ((phys_p[1:] == phys_p[:-1] + 1) & (phys_d[1:] == phys_d[:-1] + 1) & (owner[1:] == owner[:-1])
            & held[1:] & held[:-1])  # fmt: skip
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), torch.nonzero(~cont).flatten() + 1])
    ends = torch.cat([starts[1:], torch.tensor([n])])
    c = torch.zeros(n + 1, dtype=torch.int64)
    c[1:] = torch.cumsum(m.long(), 0)
    k = c[ends] - c[starts]  # mismatches per run
    out: list[TransferRun] = []
    for ri in torch.nonzero(k).flatten().tolist():
        a, b = int(starts[ri]), int(ends[ri])
        run = TransferRun(start=a, end=b, mismatched_positions=int(k[ri]),
                          first_mismatch=a + int(torch.nonzero(m[a:b])[0]),
                          pages=(a // page_size, (b - 1) // page_size),
                          prefill_slot=int(phys_p[a]), decode_slot=int(phys_d[a]))  # fmt: skip
        if len(out) < MAX_OFFSET_SEARCH:
            run.searched = True
            run.offset = _offset(r, a, b, m, prefill, decode)
            run.decode_zero_rows = _zero_rows(r, decode, a, b, m)
        out.append(run)
        if len(out) >= MAX_RANGES:
            break
    return TransferRuns(runs=int(held[starts].sum()) if n else 0, with_mismatches=int((k > 0).sum()), mismatched=out)


def _zero_rows(r: PairedRequest, decode: Capture, a: int, b: int, m: torch.Tensor) -> int:
    """Mismatched decode rows in positions [a, b) that are all zero."""
    js = torch.nonzero(m[a:b]).flatten() + a
    rows = decode.kv_indices[r.decode_at(decode, 0) + js].long()
    return int((row_words(decode.kv_buffer).index_select(0, rows) == 0).all(1).sum())


def _offset(
    r: PairedRequest, a: int, b: int, m: torch.Tensor, prefill: list[Capture], decode: Capture
) -> Optional[int]:
    """k != 0 such that every mismatched decode row j in [a, b) equals the prefill row j + k, else None."""
    s = r.sources[int(r.owner[a])]
    c = prefill[s.cap]
    if c.kv_buffer.dtype != decode.kv_buffer.dtype:
        return None
    p0 = int(c.kv_indptr[s.b])
    p_rows = c.kv_indices[p0 : p0 + s.length].long()  # [Lp] every row of that source (-1: not held)
    wp, wd = row_words(c.kv_buffer), row_words(decode.kv_buffer)
    js = torch.nonzero(m[a:b]).flatten() + a  # mismatched positions of the run
    d_rows = decode.kv_indices[r.decode_at(decode, 0) + js].long()
    target = wd[d_rows[0]]  # [W] the run's first mismatched decode row
    if bool((target == 0).all()):
        return None  # a zero row (not landed) matches any zero row: no evidence of a shift
    same = (wp.index_select(0, p_rows.clamp_min(0)) == target).all(1) & (p_rows >= 0)
    hits = torch.nonzero(same).flatten() - int(js[0])
    hits = hits[hits != 0]
    for k in sorted(hits.tolist(), key=abs)[:OFFSETS_TRIED]:
        src = js + k
        if bool(((src < 0) | (src >= s.length)).any()) or bool((p_rows[src.clamp(0, s.length - 1)] < 0).any()):
            continue
        if not bool(rows_differ(c.kv_buffer, p_rows[src], decode.kv_buffer, d_rows).any()):
            return int(k)
    return None
