"""Which context-parallel mistake reproduces a rank's partial output or its combine.

A rank: its output over other rows of its own shard (cp_local_length: masked at another length
than its shard's) or over the positions another geometry gives it (cp_shard_geometry: another
interleave or rank offset, read from the whole context). The combine: the recorded partials
merged with the lse in the other base (cp_combine_lse_base), or without one rank's partial
(cp_shard_missing). A hypothesis fits when its fp64 output passes the one comparator against
what the rank recorded, with the same mistake in fp32 as the control.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Callable, Optional

import torch

from refmla.capture import dcp
from refmla.compare import Tolerance, compare
from refmla.control import attend_control
from refmla.cp.result import CpFinding
from refmla.merging import merge_partials
from refmla.reference import attend

INTERLEAVES = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # the interleave sizes a geometry search tries


def attend_rows(q: torch.Tensor, kv: torch.Tensor, sc, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """One request's attention over rows kv [L, D] (q, kv as stored): out [1, H, Dv], lse [1, H].
    fp64: the reference; a narrower ``dtype``: the control, the same math at the decode kernel's
    rounding points (refmla.control: P rounded to the value dtype before P.V, sums in fp32)."""
    if dtype == torch.float64 or kv.shape[0] == 0:
        o, lse = attend(q.to(dtype), kv.to(dtype), sc)
    else:
        o, lse = attend_control(q, kv, sc, torch.float32)
    return o[None], lse[None]


def fits(got: torch.Tensor, make: Callable[[torch.dtype], torch.Tensor], tol: Tolerance) -> bool:
    """``got`` reproduced by ``make`` (fp64 the expectation, fp32 rounded to got's dtype the control)."""
    want, ctl = make(torch.float64), make(torch.float32).to(got.dtype)
    return compare("hypothesis", got, want, ctl, tol=tol).passed


def explain_rank(step, r: int, b: int, tol: Tolerance) -> Optional[CpFinding]:
    """Rank r's output of request b reproduced by a context-parallel mistake, or None."""
    cap, sc = step.ranks[r], step.ranks[r].scales()
    q, got, L, P = cap.q[b], cap.out[b : b + 1], int(step.total[b]), cap.meta.page_size
    n = int(dcp.local_lens(step.total[b : b + 1], step.world, r, step.interleave)[0])
    pool = cap.kv_buffer[:, 0]
    near = step.world * step.interleave  # a length off by up to one round of the ranks
    lens = {int(cap.seq_lens[b]), L // step.world, -(-L // step.world), *range(max(0, n - near), n + near + 1),
            int(dcp.local_lens(step.total[b : b + 1], step.world, r, 1)[0])} - {n}  # fmt: skip
    table = cap.block_table
    for k in sorted(lens, key=lambda k: (abs(k - n), k)):  # the nearest length first
        if table is None or k < 0 or -(-k // P) > table.shape[1] or bool((table[b, : -(-k // P)] < 0).any()):
            continue
        j = torch.arange(k)
        rows = table[b].long()[j // P] * P + j % P
        if bool((rows >= pool.shape[0]).any()):
            continue
        if fits(got, lambda d: attend_rows(q, pool.index_select(0, rows), sc, d)[0], tol):
            lo, hi = min(k, n), max(k, n)
            pos = dcp.ranges(dcp.positions(r, hi, step.world, step.interleave)[lo:])
            return CpFinding("cp_local_length", r, b, pos,
                             f"rank {r}, request {b}: its output is attention over its first {k} rows, its shard "
                             f"holds {n}: {'dropped' if k < n else 'read past its shard'} positions {pos[:4]}",
                             {"attended_len": k, "shard_len": n, "source": "output"})  # fmt: skip
    whole = step.whole(b)
    if whole is None:
        return None
    p = torch.arange(L)
    should = dcp.owner(p, step.world, step.interleave) == r
    for I in sorted(set(INTERLEAVES) | {step.interleave, P}):
        for r2 in range(step.world):
            read = dcp.owner(p, step.world, I) == r2
            if torch.equal(read, should) or not bool(read.any()):
                continue
            if fits(got, lambda d: attend_rows(q, whole[read], sc, d)[0], tol):
                extra, missed = dcp.ranges(p[read & ~should]), dcp.ranges(p[should & ~read])
                return CpFinding("cp_shard_geometry", r, b, extra,
                                 f"rank {r}, request {b}: its output is attention over the positions rank {r2} holds "
                                 f"at interleave {I}, not its own (rank {r}, interleave {step.interleave}): read "
                                 f"{len(extra)} runs not its own from {extra[:2]}, missed {missed[:2]}",
                                 {"read_as_rank": r2, "read_interleave": I, "missed": missed})  # fmt: skip
    return None


def merged(outs: torch.Tensor, lses: torch.Tensor, merge: str, dtype: torch.dtype) -> torch.Tensor:
    """The ranks' partials outs [W, B, H, Dv], lses [W, B, H] merged (refmla.merging, ``merge``)."""
    W, B, H, Dv = outs.shape
    rnd = SimpleNamespace(merge=merge, split_lse=None)
    o = merge_partials(outs.to(dtype).reshape(W, B * H, Dv), lses.to(dtype).reshape(W, B * H),
                       torch.ones(W, B * H, dtype=dtype), rnd)  # fmt: skip
    return o.reshape(B, H, Dv)


def explain_combine(step, r: int, outs: torch.Tensor, lses: torch.Tensor, heads: slice, tol: Tolerance
                    ) -> Optional[CpFinding]:  # fmt: skip
    """Rank r's combined heads (dcp_out) reproduced by a merge mistake over the recorded partials."""
    got = step.ranks[r].dcp_out
    everything = [[[0, int(L)]] for L in step.total]  # per request: its positions as runs
    for merge in ("log2_as_ln", "ln_as_log2"):
        if fits(got, lambda d: merged(outs, lses, merge, d)[:, heads], tol):
            how = "log2 lse read as natural" if merge == "log2_as_ln" else "natural lse merged with exp2"
            return CpFinding("cp_combine_lse_base", r, None, everything[0] if len(everything) == 1 else [],
                             f"rank {r}: its combined heads are the ranks' partials merged with the {how}",
                             {"merge": merge, "positions_by_request": everything})  # fmt: skip
    keep = torch.ones(outs.shape[0], dtype=torch.bool)
    for gone in range(outs.shape[0]):
        keep[:] = True
        keep[gone] = False
        if fits(got, lambda d: merged(outs[keep], lses[keep], "ln", d)[:, heads], tol):
            pos = [dcp.ranges(dcp.positions(gone, int(n), step.world, step.interleave))
                   for n in dcp.local_lens(step.total, step.world, gone, step.interleave)]  # fmt: skip
            return CpFinding("cp_shard_missing", gone, None, pos[0] if len(pos) == 1 else [],
                             f"rank {r}'s combine left out rank {gone}'s partial: its positions are missing from "
                             f"every request", {"combined_on": r, "positions_by_request": pos})  # fmt: skip
    return None


__all__ = ["INTERLEAVES", "attend_rows", "explain_combine", "explain_rank", "fits", "merged"]
