"""The reference's work in cache-sized blocks under a stated memory budget, whatever the index pattern.

Query row r attends the pool rows ``indices[starts[r] : starts[r] + lens[r]]`` (a span of a flat
index array: decode reads whole requests, a causal extend row a prefix of its request). The math
is :func:`refmla.reference.attend`'s, in ``accum_dtype``; the work is cut so that what is upcast
stays small:

    long row (L > BLOCK_ROWS): its rows BLOCK_ROWS at a time, gathered and upcast into one
        reused block [BLOCK_ROWS, D]; per block s = q @ kv.T [H, n], then an exact online-softmax
        merge in accum_dtype (running max m [H], sum l [H], unnormalised output acc [H, Dv]):
            m' = max(m, max_j s_j)   p = exp(s - m')   l = l * exp(m - m') + sum_j p_j
            acc = acc * exp(m - m') + p @ v           ->  out = acc / l * v_scale, lse = m + log l
    short rows (L <= BLOCK_ROWS): many at once, in groups of rows of one length (sorted by length,
        so at most BLOCK_ROWS lengths plus one group per GROUP_BYTES): one bmm per group for q.k and
        one for p.v, instead of one Python iteration per row.

A row's blocking depends only on its own length, never on its neighbours or the thread count, so a
row's result is the same alone, in any batch and with any number of threads. Units (one long row, or
one group of short rows) run on ``torch.get_num_threads()`` worker threads, each single-threaded: the
[H, D] x [D, n] GEMMs with H = 16 are too skinny to split, and a worker never waits on another at a
barrier (so a loaded machine slows it in proportion, not by a convoy).

Memory: each worker holds one block (:func:`unit_budget` bytes, the stated budget), besides the
outputs [R, H, Dv] and [R, H] and the int64 row spans [R]; it never depends on L.
"""

from __future__ import annotations

import contextlib
import math
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Iterator, Optional

import numpy as np
import torch

from refmla.attended import Attended
from refmla.scales import Scales

BLOCK_ROWS = 256  # rows per block: 256 x 576 fp64 = 1.2 MB, about one core's L2 (measured: tools/bench_reference.py)
GROUP_BYTES = 4 << 20  # a group of short rows: its q, logits, output and rows in accum_dtype at most this
MAX_GROUP = 4096  # query rows per group at most (one bmm each)


@dataclass(frozen=True)
class Spans:
    """Span r attends pool rows indices[starts[r] : starts[r] + lens[r]] with query row query[r]."""

    indices: torch.Tensor  # [nnz] pool rows, in position order within each span
    starts: torch.Tensor  # [R] int64
    lens: torch.Tensor  # [R] int64
    query: Optional[torch.Tensor] = None  # [R] int64: the row of q each span uses (None: span r uses q[r])

    @staticmethod
    def of_attended(att: Attended) -> "Spans":
        """What each query row of ``att`` sees: a prefix of its group (decode, extend, chain verify:
        no copy), or for a tree mask its visible rows, gathered into one flat array."""
        starts = att.indptr[:-1][att.group_of_row]  # [R]
        if att.mask is None:
            lens = att.causal_len if att.causal_len is not None else att.lengths()[att.group_of_row]
            return Spans(att.rows, starts, lens.long())
        seen = [att.group_rows(g)[vis] for g in range(att.num_groups) for vis in att.visibility(g)]
        lens = torch.tensor([len(r) for r in seen], dtype=torch.long)  # [R]
        flat = torch.cat(seen) if seen else att.rows[:0]
        return Spans(flat, torch.cumsum(lens, 0) - lens, lens)


def unit_budget(H: int, D: int, Dv: int, stored_itemsize: int, itemsize: int = 8) -> int:
    """Bytes one worker may hold besides the outputs (the stated budget), at most: one long row's
    block (its rows as stored and upcast, logits [H, BLOCK_ROWS], q, acc) plus one group of short
    rows (GROUP_BYTES, and its rows as stored)."""
    block = BLOCK_ROWS * D * (stored_itemsize + itemsize) + H * (BLOCK_ROWS + D + 2 * Dv + 4) * itemsize
    return block + GROUP_BYTES + BLOCK_ROWS * D * stored_itemsize


def attend_spans(
    q: torch.Tensor, kv_buffer: torch.Tensor, spans: Spans, sc: Scales, accum_dtype: torch.dtype = torch.float64
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [Q, H, D] (stored dtype), kv_buffer [N, 1, D] -> out [R, H, Dv], lse [R, H] in accum_dtype.

    Span r: attention of its query row's H heads over its rows; an empty span gives 0 / -inf."""
    R, H = spans.lens.shape[0], q.shape[1]
    out = torch.zeros(R, H, sc.kv_lora_rank, dtype=accum_dtype, device=q.device)  # [R, H, Dv]
    lse = torch.full((R, H), -math.inf, dtype=accum_dtype, device=q.device)  # [R, H]
    job = _Job(q, kv_buffer[:, 0], spans, sc, accum_dtype, out, lse)
    units = list(plan(spans.lens, H, q.shape[-1], sc.kv_lora_rank, accum_dtype.itemsize))
    run_units(job.run, units)
    return out, lse


def plan(lens: torch.Tensor, H: int, D: int, Dv: int, itemsize: int = 8) -> Iterator[tuple[str, torch.Tensor]]:
    """The units of work: ("long", [r]) for each row past BLOCK_ROWS, ("short", rows) for groups of
    short rows of one length (stable order), each within GROUP_BYTES and MAX_GROUP rows."""
    n = lens.cpu().numpy()  # numpy: its stable sort of 10^6 lengths takes milliseconds
    for r in np.flatnonzero(n > BLOCK_ROWS).tolist():
        yield "long", torch.tensor([r])
    short = np.flatnonzero((n > 0) & (n <= BLOCK_ROWS))
    order = short[np.argsort(n[short], kind="stable")]  # short rows, shortest first
    values, firsts, counts = np.unique(n[order], return_index=True, return_counts=True)  # <= BLOCK_ROWS lengths
    for L, i, c in zip(values.tolist(), firsts.tolist(), counts.tolist()):  # a group: rows of one length
        size = group_size(L, H, D, Dv, itemsize)
        for j in range(i, i + c, size):
            yield "short", torch.from_numpy(order[j : min(j + size, i + c)].copy())


def group_size(L: int, H: int, D: int, Dv: int, itemsize: int = 8) -> int:
    """How many rows of length L one group holds: q [G, H, D], rows [G, L, D], logits [G, H, L] and
    output [G, H, Dv] in accum_dtype within GROUP_BYTES, at most MAX_GROUP, at least 1."""
    return max(1, min(MAX_GROUP, GROUP_BYTES // ((H * D + L * D + H * L + H * Dv) * itemsize)))


def run_units(fn, units: list) -> None:
    """fn(unit) for every unit, on torch.get_num_threads() single-threaded workers (inline for one)."""
    n = min(torch.get_num_threads(), len(units))
    if n <= 1:
        with _torch_threads(1):
            for u in units:
                fn(u)
        return
    with _torch_threads(1), ThreadPoolExecutor(n, initializer=torch.set_num_threads, initargs=(1,)) as ex:
        for _ in ex.map(fn, units):  # re-raises a worker's exception here
            pass


@contextlib.contextmanager
def _torch_threads(n: int):
    """torch.set_num_threads(n) for the block, restored after (workers start with it as their own)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class _Job:
    """One attend_spans call: the inputs, the outputs each unit writes its rows of, per-thread blocks."""

    def __init__(self, q, pool, spans: Spans, sc: Scales, dtype, out, lse):
        self.q, self.pool, self.spans, self.sc, self.dtype, self.out, self.lse = q, pool, spans, sc, dtype, out, lse
        self.indices = spans.indices.to(pool.device)
        self.local = threading.local()

    def run(self, unit: tuple[str, torch.Tensor]) -> None:
        kind, rows = unit
        if kind == "long":
            r = int(rows[0])
            self.out[r], self.lse[r] = self.long_row(r)
        elif int(rows[-1]) - int(rows[0]) + 1 == len(rows):  # consecutive rows (ascending): write in place
            r0, r1 = int(rows[0]), int(rows[-1]) + 1
            self.short_group(rows, self.out[r0:r1], self.lse[r0:r1])
        else:
            self.out[rows], self.lse[rows] = self.short_group(rows)

    def qrow(self, r):
        """The q row (or rows) span r (or spans) attend with."""
        return r if self.spans.query is None else self.spans.query[r]

    def block(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This thread's reused block buffers: rows as stored [n, D] and upcast [n, D]."""
        bufs = getattr(self.local, "bufs", None)
        if bufs is None or bufs[0].shape[0] < n:
            D = self.pool.shape[-1]
            size = max(n, BLOCK_ROWS)
            bufs = (self.pool.new_empty(size, D), self.pool.new_empty(size, D, dtype=self.dtype))
            self.local.bufs = bufs
        return bufs[0][:n], bufs[1][:n]

    def long_row(self, r: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One row over its span in blocks of BLOCK_ROWS, merged online (module docstring)."""
        sc, Dv = self.sc, self.sc.kv_lora_rank
        q = self.q[self.qrow(r)].to(self.dtype)  # [H, D]
        start, L = int(self.spans.starts[r]), int(self.spans.lens[r])
        m = l = acc = None
        for b0 in range(0, L, BLOCK_ROWS):
            n = min(BLOCK_ROWS, L - b0)
            stored, kv = self.block(n)
            torch.index_select(self.pool, 0, self.indices[start + b0 : start + b0 + n].long(), out=stored)
            kv.copy_(stored)  # [n, D]
            s = logits(q @ kv.T, sc)  # [H, n]
            mb = s.amax(dim=-1)  # [H]
            if m is None:
                m = mb
                p = s.sub_(m[:, None]).exp_()  # [H, n]
                l, acc = p.sum(dim=-1), p @ kv[:, :Dv]  # [H], [H, Dv]
                continue
            m_new = torch.maximum(m, mb)  # [H]
            alpha = (m - m_new).exp_()  # [H]
            p = s.sub_(m_new[:, None]).exp_()  # [H, n]
            l = l.mul_(alpha).add_(p.sum(dim=-1))  # [H]
            acc = acc.mul_(alpha[:, None]).addmm_(p, kv[:, :Dv])  # [H, Dv]
            m = m_new
        return acc.div_(l[:, None]).mul_(sc.v_scale), m.add_(l.log())

    def short_group(self, rows: torch.Tensor, out=None, lse=None) -> tuple[torch.Tensor, torch.Tensor]:
        """G rows of one length L <= BLOCK_ROWS: q.k and p.v as one bmm each (into ``out`` [G, H, Dv]
        and ``lse`` [G, H] when given)."""
        sc, Dv = self.sc, self.sc.kv_lora_rank
        starts, G, L, D = self.spans.starts[rows], len(rows), int(self.spans.lens[rows[0]]), self.pool.shape[-1]
        flat = (starts[:, None] + torch.arange(L)[None, :]).reshape(-1)  # [G * L] positions in indices
        stored, kv = self.block(G * L)
        torch.index_select(self.pool, 0, self.indices[flat.to(self.indices.device)].long(), out=stored)
        kv = kv.copy_(stored).view(G, L, D)  # [G, L, D]
        q = self.q[self.qrow(rows).to(self.q.device)].to(self.dtype)  # [G, H, D]
        if L == 1:  # one row: a dot per head (a GEMV's summation order depends on the batch size)
            s = logits((q * kv).sum(-1, keepdim=True), sc)  # [G, H, 1]
        else:
            s = logits(torch.bmm(q, kv.transpose(1, 2)), sc)  # [G, H, L]
        m = s.amax(dim=-1)  # [G, H]
        p = s.sub_(m[..., None]).exp_()  # [G, H, L]
        l = p.sum(dim=-1)  # [G, H]
        acc = torch.bmm(p, kv[..., :Dv], out=out)  # [G, H, Dv]
        return acc.div_(l[..., None]).mul_(sc.v_scale), torch.add(m, l.log_(), out=lse)


def logits(s: torch.Tensor, sc: Scales) -> torch.Tensor:
    """q.k [.., H, n] -> the scaled (and capped) logits, in place."""
    s = s.mul_(sc.sm_scale * sc.k_scale)
    if sc.logit_cap > 0:
        s = s.div_(sc.logit_cap).tanh_().mul_(sc.logit_cap)  # cap * tanh(s / cap)
    return s
