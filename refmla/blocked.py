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
row's result is the same alone, in any batch and with any number of threads. Units run on
``torch.get_num_threads()`` worker threads, each single-threaded (the [H, D] x [D, n] GEMMs with
H = 16 are too skinny to split, and a worker never waits on another at a barrier), longest first: a
unit is one group of short rows, or up to :func:`long_batch` long rows in lockstep (block j of each
at once: one bmm for q.k and one for p.v over the rows that have a whole block j, the softmax merge
as one op over all of them, a row's last partial block alone). Every torch call from Python takes
the GIL, and two workers running Python take turns at it at every call. So the lockstep loop
(:func:`lockstep`) runs compiled by TorchScript, which releases the GIL for the whole unit: one call
from Python per unit (tools/bench_reference.py times it both ways side by side). Where
torch has no TorchScript (or $REFMLA_NO_TORCHSCRIPT is set) the same function runs as Python, and a
step still makes 13 calls whatever its number of rows (one gather, one upcast, q.k, its scale and 9
for the merge: the running max rides in the logits' last column). Batching changes no bits: bmm
runs one GEMM per entry, and the elementwise ops and reductions work row by row; compiled or not,
the same ops (tests/test_blocked.py checks rows alone, batched, 1 and 2 threads, both ways).

Memory: each worker holds at most :func:`unit_budget` bytes (the stated budget), besides the outputs
[R, H, Dv] and [R, H] and the int64 row spans [R]; it never depends on L. The first call in a process
also compiles the loop, once: COMPILE_BYTES at most (tools/bench_reference.py's first-call peak: +5-7 MiB).
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import sys
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Iterator, List, Optional, Tuple

import numpy as np
import torch

from refmla.attended import Attended
from refmla.scales import Scales

BLOCK_ROWS = 256  # rows per block: 256 x 576 fp64 = 1.2 MB, about one core's L2 (measured: tools/bench_reference.py)
GROUP_BYTES = 4 << 20  # a group of short rows: its q, logits, output and rows in accum_dtype at most this
MAX_GROUP = 4096  # query rows per group at most (one bmm each)
GRID_BLOCKS = 16  # a lockstep unit lays out its rows' pool indices this many blocks at a time
COMPILE_BYTES = 8 << 20  # TorchScript's compile of the lockstep loop, once per process (measured +5-7 MiB)


@dataclass(frozen=True)
class Spans:
    """Span r attends pool rows indices[starts[r] : starts[r] + lens[r]] with query row query[r]."""

    indices: torch.Tensor  # [nnz] pool rows, in position order within each span
    starts: torch.Tensor  # [R] int64
    lens: torch.Tensor  # [R] int64
    query: Optional[torch.Tensor] = None  # [R] int64: the row of q each span uses (None: span r uses q[r])
    fresh_from: Optional[torch.Tensor] = None  # [R] int64: span r's entries from this one on are new tokens

    @staticmethod
    def of_attended(att: Attended, fresh: bool = False) -> "Spans":
        """What each query row of ``att`` sees: a prefix of its group (decode, extend, chain verify:
        no copy), or for a tree mask its visible rows, gathered into one flat array. ``fresh``: with
        ``fresh_from``, where each span's entries among the call's new tokens begin
        (:meth:`Attended.new_tokens`: an extend kernel reads them from ``k_extend``, not the cache)."""
        starts = att.indptr[:-1][att.group_of_row]  # [R]
        cached = (att.lengths() - att.new_tokens())[att.group_of_row] if fresh else None  # [R] prefix lengths
        if att.mask is None:
            lens = (att.causal_len if att.causal_len is not None else att.lengths()[att.group_of_row]).long()
            return Spans(att.rows, starts, lens, fresh_from=None if cached is None else torch.minimum(lens, cached))
        vis = [v for g in range(att.num_groups) for v in att.visibility(g)]  # [L_g] per query row
        seen = [att.group_rows(int(g))[v] for g, v in zip(att.group_of_row, vis)]
        lens = torch.tensor([len(r) for r in seen], dtype=torch.long)  # [R]
        flat = torch.cat(seen) if seen else att.rows[:0]
        ff = None if cached is None else torch.tensor([int(v[: int(c)].sum()) for v, c in zip(vis, cached)]).long()
        return Spans(flat, torch.cumsum(lens, 0) - lens, lens, fresh_from=ff)


def unit_budget(H: int, D: int, Dv: int, stored_itemsize: int, itemsize: int = 8) -> int:
    """Bytes one worker may hold besides the outputs (the stated budget), at most: one long row's
    share of a lockstep unit (:func:`_row_block`) plus one group of short rows (GROUP_BYTES,
    and its rows as stored)."""
    return _row_block(H, D, Dv, stored_itemsize, itemsize) + GROUP_BYTES + BLOCK_ROWS * D * stored_itemsize


def long_batch(H: int, D: int, Dv: int, stored_itemsize: int, itemsize: int = 8) -> int:
    """How many long rows one unit runs in lockstep within :func:`unit_budget`: each holds one block
    (rows as stored and upcast) and its q, logits, acc and merge state (3 at H = 16, D = 576)."""
    block = _row_block(H, D, Dv, stored_itemsize, itemsize)
    return max(1, unit_budget(H, D, Dv, stored_itemsize, itemsize) // block)


def _row_block(H: int, D: int, Dv: int, stored_itemsize: int, itemsize: int) -> int:
    """Bytes one long row holds in a unit: its block as stored and upcast, its logits (and running
    max) [H, BLOCK_ROWS + 1], q [H, D], acc and output [H, Dv], m, l, lse [H], and its int64 pool
    indices for GRID_BLOCKS blocks."""
    per_head = H * (BLOCK_ROWS + 1 + D + 2 * Dv + 3) * itemsize
    return BLOCK_ROWS * D * (stored_itemsize + itemsize) + per_head + GRID_BLOCKS * BLOCK_ROWS * 8


def attend_spans(
    q: torch.Tensor, kv_buffer: torch.Tensor, spans: Spans, sc: Scales, accum_dtype: torch.dtype = torch.float64
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [Q, H, D] (stored dtype), kv_buffer [N, 1, D] -> out [R, H, Dv], lse [R, H] in accum_dtype.

    Span r: attention of its query row's H heads over its rows; an empty span gives 0 / -inf."""
    R, H, D, Dv = spans.lens.shape[0], q.shape[1], q.shape[-1], sc.kv_lora_rank
    out = torch.zeros(R, H, Dv, dtype=accum_dtype, device=q.device)  # [R, H, Dv]
    lse = torch.full((R, H), -math.inf, dtype=accum_dtype, device=q.device)  # [R, H]
    job = _Job(q, kv_buffer[:, 0], spans, sc, accum_dtype, out, lse)
    most = long_batch(H, D, Dv, kv_buffer.dtype.itemsize, accum_dtype.itemsize)
    units = list(plan(spans.lens, H, D, Dv, accum_dtype.itemsize, most, torch.get_num_threads()))
    run_units(job.run, units)
    return out, lse


UNITS_PER_WORKER = 4  # lockstep batches shrink until each worker has this many long units, when it can


def plan(
    lens: torch.Tensor, H: int, D: int, Dv: int, itemsize: int = 8, lockstep: int = 1, workers: int = 1
) -> Iterator[tuple[str, torch.Tensor]]:
    """The units of work: ("long", rows) for the rows past BLOCK_ROWS, longest first, up to
    ``lockstep`` of them each (fewer when ``workers`` would get under UNITS_PER_WORKER units; with
    several workers the last ``workers`` units split into single rows, so that they finish within
    a row of each other; the split never changes a row's bits, only how evenly the workers finish), ("short", rows) for
    groups of short rows of one length (stable order), each within GROUP_BYTES and MAX_GROUP rows."""
    n = lens.cpu().numpy()  # numpy: its stable sort of 10^6 lengths takes milliseconds
    long = np.flatnonzero(n > BLOCK_ROWS)
    long = long[np.argsort(-n[long], kind="stable")]  # longest first: the last units to start are short
    k = max(1, min(lockstep, len(long) // (UNITS_PER_WORKER * max(workers, 1))))
    units = [long[i : i + k] for i in range(0, len(long), k)]
    if workers > 1 and k > 1 and len(units) > workers:  # the last units a row each: the workers finish together
        units[-workers:] = [row[None] for row in np.concatenate(units[-workers:])]
    for rows in units:
        yield "long", torch.from_numpy(rows.copy())
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
        self.lockstep = lockstep_fn()  # compiled here, on the calling thread, before any worker starts

    def run(self, unit: tuple[str, torch.Tensor]) -> None:
        kind, rows = unit
        if kind == "long":
            self.out[rows], self.lse[rows] = self.long_rows(rows)
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

    def long_rows(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k rows (longest first) over their spans in blocks of BLOCK_ROWS, in lockstep, merged
        online (:func:`lockstep`, run by TorchScript without the GIL where torch has it). Returns
        out [k, H, Dv], lse [k, H]."""
        sc, k = self.sc, len(rows)
        q = self.q[self.qrow(rows).to(self.q.device)].to(self.dtype)  # [k, H, D]
        starts, lens = self.spans.starts[rows].tolist(), self.spans.lens[rows].tolist()
        stored, kv = self.block(k * BLOCK_ROWS)  # [k * n, D] as stored and upcast
        m, l, acc = self.lockstep(self.pool, self.indices, q, starts, lens, stored, kv, BLOCK_ROWS, sc.kv_lora_rank,
                                  GRID_BLOCKS, float(sc.sm_scale * sc.k_scale), float(sc.logit_cap))  # fmt: skip
        return acc.div_(l).mul_(sc.v_scale), m.add_(l.log()).squeeze(-1)

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


def lockstep(
    pool: torch.Tensor,
    indices: torch.Tensor,
    q: torch.Tensor,
    starts: List[int],
    lens: List[int],
    stored: torch.Tensor,
    kv: torch.Tensor,
    n: int,
    Dv: int,
    grid_blocks: int,
    scale: float,
    cap: float,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """k long rows (longest first; row i attends pool rows indices[starts[i] : starts[i] + lens[i]]
    with q [k, H, D]) in blocks of n, merged online (module docstring) -> m, l [k, H, 1] and the
    unnormalised acc [k, H, Dv]. Step j: block j of the w rows that have a whole one (a prefix:
    longest first) as one gather, one upcast into ``stored`` / ``kv`` [>= k * n, D] and one bmm
    pair; then each row's last partial block alone. The running max rides in the logits' last
    column, so that one amax gives max(m, max_j s_j) and one exp both p and exp(m - m') (the same
    elementwise ops on the same numbers as :func:`merge`). Written in the Python that TorchScript
    compiles: :func:`lockstep_fn` runs it compiled, without the GIL, or as plain Python; the same
    bits (tests/test_blocked.py)."""
    k, H, D = q.shape[0], q.shape[1], q.shape[2]
    whole = [L // n for L in lens]  # whole blocks per row: non-increasing, each >= 1 (a long row)
    grid = torch.empty([min(whole[0], grid_blocks), k * n], dtype=indices.dtype, device=indices.device)
    sx = torch.empty([k, H, n + 1], dtype=q.dtype, device=q.device)  # [k, H, n] logits | [k, H, 1] max
    m = torch.empty([k, H, 1], dtype=q.dtype, device=q.device)
    l = torch.empty([k, H, 1], dtype=q.dtype, device=q.device)
    acc = torch.empty([k, H, Dv], dtype=q.dtype, device=q.device)
    for j in range(whole[0]):
        if j % grid_blocks == 0:  # the pool rows of the next grid_blocks blocks, row by row
            for i in range(k):
                c = min(whole[i] - j, grid_blocks)
                if c > 0:
                    grid[:c, i * n : (i + 1) * n] = indices[starts[i] + j * n : starts[i] + (j + c) * n].view(c, n)
        w = 0  # rows with a whole block j
        for b in whole:
            if b > j:
                w += 1
        torch.index_select(pool, 0, grid[j % grid_blocks, : w * n], out=stored[: w * n])
        kv_w = kv[: w * n].view(w, n, D)
        kv_w.copy_(stored[: w * n].view(w, n, D))  # [w, n, D]
        v = kv_w[:, :, :Dv]  # [w, n, Dv]
        s = sx[:w, :, :n]  # [w, H, n]: the logits, then p
        _logits(torch.bmm(q[:w], kv_w.transpose(1, 2), out=s), scale, cap)
        if j == 0:  # every row has block 0 whole
            torch.amax(s, dim=-1, keepdim=True, out=m)
            s.sub_(m).exp_()
            torch.sum(s, dim=-1, keepdim=True, out=l)
            torch.bmm(s, v, out=acc)
        else:
            alpha = sx[:w, :, n:]  # [w, H, 1]: the running max m, then exp(m - m')
            alpha.copy_(m[:w])
            torch.amax(sx[:w], dim=-1, keepdim=True, out=m[:w])  # m' = max(m, max_j s_j)
            sx[:w].sub_(m[:w]).exp_()  # p = exp(s - m'), alpha = exp(m - m')
            l[:w].mul_(alpha).add_(s.sum(dim=-1, keepdim=True))
            acc[:w].mul_(alpha).baddbmm_(s, v)
    for i in range(k):  # a last partial block: [r, D]
        r = lens[i] % n
        if r > 0:
            end = starts[i] + lens[i]
            torch.index_select(pool, 0, indices[end - r : end], out=stored[:r])
            part = kv[:r]
            part.copy_(stored[:r])
            merge(m[i], l[i], acc[i], _logits(torch.mm(q[i], part.t()), scale, cap), part[:, :Dv])
    return m, l, acc


def merge(m: torch.Tensor, l: torch.Tensor, acc: torch.Tensor, s: torch.Tensor, v: torch.Tensor) -> None:
    """One block into the running state, in place: m, l [.., H, 1], acc [.., H, Dv], logits s
    [.., H, n], v [.., n, Dv] (one row, or a batch of them)."""
    m_new = torch.maximum(m, s.amax(dim=-1, keepdim=True))  # [.., H, 1]
    alpha = (m - m_new).exp_()  # [.., H, 1]
    p = s.sub_(m_new).exp_()  # [.., H, n]
    l.mul_(alpha).add_(p.sum(dim=-1, keepdim=True))
    acc.mul_(alpha)
    if acc.dim() == 3:
        acc.baddbmm_(p, v)
    else:
        acc.addmm_(p, v)
    m.copy_(m_new)


def logits(s: torch.Tensor, sc: Scales) -> torch.Tensor:
    """q.k [.., H, n] -> the scaled (and capped) logits, in place."""
    return _logits(s, sc.sm_scale * sc.k_scale, float(sc.logit_cap))


def _logits(s: torch.Tensor, scale: float, cap: float) -> torch.Tensor:
    s = s.mul_(scale)
    if cap > 0:
        s = s.div_(cap).tanh_().mul_(cap)  # cap * tanh(s / cap)
    return s


NO_TORCHSCRIPT = "REFMLA_NO_TORCHSCRIPT"  # set (to anything): the lockstep loop runs as plain Python


def lockstep_fn():
    """:func:`lockstep` compiled by TorchScript (once per process): it releases the GIL while it runs,
    where two workers running it as Python take turns at the GIL for every torch call. torch marks
    torch.jit.script deprecated (for torch.compile, whose generated kernels would not be the eager
    ops' bits); where it is gone or fails, on Python 3.14+ (torch: it "may break" there) or while
    $REFMLA_NO_TORCHSCRIPT is set, the same function runs as Python."""
    if os.environ.get(NO_TORCHSCRIPT) or sys.version_info >= (3, 14):
        return lockstep
    return _compiled()


@functools.lru_cache(maxsize=None)
def _compiled():
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the deprecation (above)
            return torch.jit.script(lockstep)
    except Exception:  # noqa: BLE001 - any failure to compile leaves the plain function: the same math
        return lockstep
