"""The positions of one request (or one split of it) that the evidence points at.

The reference is recomputed with each block of positions removed (or read as zeros): a page when
the capture's page_size > 1, else 64 positions. A block whose removal brings the kernel's row back
within its allowance is narrowed: its start moved forward and its end back while the removal still
restores: the pages are reported, the narrowed positions as the evidence inside them (the last
positions of a page can weigh too little to tell apart; a page is what a transfer or page-table
bug loses). Neighbouring blocks are added while they help, so a run of missing pages is reported
whole. When no block restores, every block's heads and tails (halves, quarters, ...) and the blocks
shifted by half a block (a range straddling two blocks) are tried, then (a short segment) every
range of positions, ranked by one GEMM (a nearest-neighbour search); the roundest that restores reported and
narrowed; then parts of the most promising block (single positions: a split that drops its
last one; a page's head or tail), and failing that the block whose removal takes most of the error
away is reported as carrying it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from refmla import reference as ref
from refmla.localize.types import Span
from refmla.nearest import nearest_ranges, projection
from refmla.util import roundness

BLOCK = 64  # positions per block when the capture is not paged
SINGLES = 512  # a split up to this long has each of its positions tried alone
HEAD_MIN = 8  # the shortest head or tail of a block the bisection tries
BISECT_CONFIRM = 8  # ranges of the bisection recomputed after the screen
SCREEN_BUDGET = 2**25  # values (fp64) the bisection's screen may hold: [points, H, Dv]
CHUNK = 2**19  # values per chunk of positions / ranges in the screen (one that stays in cache)
RANK_WIDTH = 8  # the every-range ranking's value axis, projected
NEAREST_KEEP = 512  # ranges (removed, and zeroed) the every-range ranking keeps for the screen


@dataclass
class Segment:
    """Positions [offset, offset + L) of one request, the kernel's row over them and its allowance."""

    request: int
    offset: int  # first position of the segment in the request
    q: torch.Tensor  # [H, D] fp64
    kv: torch.Tensor  # [L, D] fp64, position order
    target: torch.Tensor  # [H, Dv] fp64: what the kernel wrote for these positions
    tol: torch.Tensor  # [H] the comparator's allowance per head
    page_size: int = 1
    split: Optional[int] = None

    def ratio(self, drop: Optional[tuple[int, int]] = None, zero: bool = False) -> float:
        """Worst head's |target - reference| / allowance, with positions [a, e) of the segment
        removed (or read as zeros)."""
        kv, L = self.kv, self.kv.shape[0]
        if drop is not None:
            a, e = drop
            if zero:
                kv = kv.clone()
                kv[a:e] = 0
            else:
                kv = kv[torch.cat([torch.arange(0, a), torch.arange(e, L)])]
        if kv.shape[0] == 0:
            return float("inf")
        out = ref.attend(self.q, kv, self.sc)[0]  # [H, Dv]
        return float(((self.target - out).abs().amax(-1) / self.tol).nan_to_num(float("inf")).max())

    sc: ref.Scales = None  # type: ignore[assignment]

    def span(self, a: int, e: int, how: str, share: Optional[float] = None, evidence=None) -> Span:
        s, t = self.offset + a, self.offset + e
        P = self.page_size
        pages = (s // P, (t - 1) // P) if P > 1 else None
        ev = (self.offset + evidence[0], self.offset + evidence[1]) if evidence and evidence != (a, e) else None
        return Span(self.request, s, t, how, pages=pages, split=self.split, share=share, evidence=ev)


def blocks(seg: Segment) -> list[tuple[int, int]]:
    """Page-aligned blocks of the segment (in request positions), clipped to it."""
    L, P = seg.kv.shape[0], seg.page_size if seg.page_size > 1 else BLOCK
    first = (seg.offset // P) * P
    return [(max(a, seg.offset) - seg.offset, min(a + P, seg.offset + L) - seg.offset)
            for a in range(first, seg.offset + L, P)]  # fmt: skip


def locate(seg: Segment) -> Optional[Span]:
    """The pages (blocks) of ``seg`` whose removal (or zeroing) restores the row, with the positions
    inside them that carry the evidence; a sub-page range only when no whole page restores but it
    does; else the block carrying most of the error; None when removing nothing helps."""
    base = seg.ratio()
    if base <= 1:
        return None
    tried = block_ratios(seg)
    (best, zero), r = min(tried.items(), key=lambda kv: kv[1])
    (a, e), r = _grow(seg, best, zero, r)
    how = "reading them as zeros restores the output" if zero else "their removal restores the output"
    if r <= 1:
        return seg.span(a, e, how, evidence=_narrow(seg, a, e, zero))
    part = _bisect(seg) or _every_range(seg)
    if part is not None:
        (x, y), zero = part
        how = "reading them as zeros restores the output" if zero else "their removal restores the output"
        return seg.span(x, y, how + " (not whole pages')" if seg.page_size > 1 else how,
                        evidence=_narrow(seg, x, y, zero))  # fmt: skip
    for x, y in _inside(seg, best):  # a part of a page: only when the data tell it from the page
        if seg.ratio((x, y)) <= 1:
            return seg.span(x, y, "their removal restores the output (not the whole page's)")
    share = 1 - tried[(best, zero)] / base
    return seg.span(*best, "carries the error", share=share) if share > 0.05 else None


def block_ratios(seg: Segment) -> dict[tuple[tuple[int, int], bool], float]:
    """(block, zeroed) -> the row's ratio with that block removed (or read as zeros), every block's
    from one pass over the segment (:func:`_screen`: per-block sums of exp(logit) and exp(logit) v,
    merged, so that the whole costs about one attention, not two a block); the blocks that hold a
    head's largest logit (where the merge of the rest may lose its digits) and the best
    BISECT_CONFIRM recomputed whole (:meth:`Segment.ratio`). Every block whole past SCREEN_BUDGET."""
    blks = blocks(seg)
    if 2 * (len(blks) + 1) * seg.q.shape[0] * seg.sc.kv_lora_rank > SCREEN_BUDGET:
        return {(b, z): seg.ratio(b, z) for b in blks for z in (False, True)}
    starts, ends = torch.tensor([a for a, _ in blks]), torch.tensor([e for _, e in blks])
    screened = torch.stack([_screen(seg, starts, ends, z) for z in (False, True)], 1)  # [nb, 2]
    tried = {(b, z): float(screened[i, int(z)]) for i, b in enumerate(blks) for z in (False, True)}
    top = seg.q @ seg.kv.T  # [H, L]: each head's largest logit (the scale and cap keep its place)
    peaks = set(torch.bucketize(top.argmax(-1), ends, right=True).tolist())  # [H] -> blocks
    order = torch.argsort(screened.flatten().nan_to_num(float("inf")))[:BISECT_CONFIRM].tolist()
    exact = {(blks[i], bool(z)) for i, z in {(i, z) for i in peaks for z in (0, 1)} | {divmod(k, 2) for k in order}}
    for key in exact:
        tried[key] = seg.ratio(*key)
    while True:  # the best is a whole recomputation, never a screened value
        key = min(tried, key=tried.__getitem__)
        if key in exact:
            return tried
        tried[key], _ = seg.ratio(*key), exact.add(key)


def _bisect(seg: Segment) -> Optional[tuple[tuple[int, int], bool]]:
    """A range no whole block holds whose removal (or zeroing) restores the row, or None: every
    block's heads and tails (halves, quarters, ... down to HEAD_MIN positions) and the blocks shifted
    by half a block (a range straddling two blocks), screened at once from prefix sums of the
    softmax (:func:`_screen`), the best BISECT_CONFIRM recomputed; the best that restores."""
    L, P = seg.kv.shape[0], seg.page_size if seg.page_size > 1 else BLOCK
    tries: set[tuple[int, int]] = set()
    for a, e in blocks(seg) + [(max(0, a + P // 2), min(L, e + P // 2)) for a, e in blocks(seg)]:
        k = e - a
        while k >= HEAD_MIN:
            tries |= {(a, e), (a, a + k), (e - k, e)}
            k //= 2
    ranges = sorted(t for t in tries if t[1] > t[0])
    if not ranges or 2 * len(ranges) * seg.q.shape[0] * seg.sc.kv_lora_rank > SCREEN_BUDGET:
        return None  # nothing to try, or a request too long for the screen's sums (bounded memory)
    starts, ends = torch.tensor([a for a, _ in ranges]), torch.tensor([e for _, e in ranges])
    return _restoring(seg, starts, ends)


def _every_range(seg: Segment) -> Optional[tuple[tuple[int, int], bool]]:
    """Every range of positions (a zeroed run inside a page that no head or tail of a block
    matches), ranked at once by one GEMM (:func:`_nearest`), the nearest NEAREST_KEEP screened and
    the best BISECT_CONFIRM recomputed: the best that restores. None past SCREEN_BUDGET."""
    L, H = seg.kv.shape[0], seg.q.shape[0]
    if (L + 1) * H * seg.sc.kv_lora_rank > SCREEN_BUDGET:
        return None
    ranges = torch.cat([torch.stack(_nearest(seg, z)) for z in (False, True)], 1).unique(dim=1)  # [2, K]
    return _restoring(seg, ranges[0], ranges[1])


def _nearest(seg: Segment, zero: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The NEAREST_KEEP ranges [a, e) whose removal (zeroing) nearest restores the target: removing
    [a, e) fits when Q_e - Q_a = R, Q_p = sum_{x < p} w_x (v_x - target) (zeroing: plus p e^-m
    target), R = sum of all w (v - target); each head scaled by 1 / (Z tol), the value axis
    projected to RANK_WIDTH: a nearest-neighbour search between Q_a + R and Q_e (refmla.nearest;
    R = Q_L)."""
    sc, Dv, L = seg.sc, seg.sc.kv_lora_rank, seg.kv.shape[0]
    s = seg.q @ seg.kv.T * (sc.sm_scale * sc.k_scale)  # [H, L]
    if sc.logit_cap > 0:
        s = sc.logit_cap * torch.tanh(s / sc.logit_cap)
    m = s.amax(-1, keepdim=True)  # [H, 1]
    p = torch.exp(s - m)  # [H, L]
    proj = projection(Dv, RANK_WIDTH)
    w = p.T[..., None] * ((seg.kv[:, :Dv] * sc.v_scale) @ proj)[:, None] - p.T[..., None] * (seg.target @ proj)[None]  # [L, H, w]
    if zero:
        w = w + torch.exp(-m)[None] * (seg.target @ proj)[None]  # a zero row: weight e^-m, value 0
    Q = torch.cat([torch.zeros_like(w[:1]), w.cumsum(0)])  # [L + 1, H, w]
    Q = (Q * (1 / (p.sum(-1) * seg.tol))[None, :, None]).flatten(1)  # each head scaled by 1 / (Z tol)
    a, e, _ = nearest_ranges(Q, Q[-1], NEAREST_KEEP)
    return a, e


def _restoring(seg: Segment, starts: torch.Tensor, ends: torch.Tensor):
    """Of the ranges [starts[k], ends[k]), screened removed and zeroed, the best BISECT_CONFIRM
    recomputed: (the range, zeroed) that restores, the roundest (util.roundness), then with the
    lowest ratio, then the longest; or None."""
    scores = torch.stack([_screen(seg, starts, ends, z) for z in (False, True)])  # [2, K]
    best = torch.argsort(scores.flatten())[:BISECT_CONFIRM].tolist()
    restoring = []
    for k in best:
        z, i = divmod(k, len(starts))
        rng = (int(starts[i]), int(ends[i]))
        r = seg.ratio(rng, bool(z))
        if r <= 1:
            restoring.append((-roundness(*rng), r, -(rng[1] - rng[0]), rng, bool(z)))
    if not restoring:
        return None
    *_, x, z = min(restoring)
    return x, z


def _screen(seg: Segment, starts: torch.Tensor, ends: torch.Tensor, zero: bool) -> torch.Tensor:
    """Worst head's |target - attention| / allowance with each [starts[k], ends[k]) removed (or
    zeroed) [K], from sums of exp(logit) and exp(logit) v between the ranges' ends: a ranking (the
    softmax is linear in the kept positions), the verdict stays :meth:`Segment.ratio`. Holds
    [points, H, Dv] (the caller bounds it: SCREEN_BUDGET) and chunks of positions and of ranges."""
    sc, Dv, L = seg.sc, seg.sc.kv_lora_rank, seg.kv.shape[0]
    V, target = seg.kv[:, :Dv] * sc.v_scale, seg.target  # [L, Dv], [H, Dv]
    s = seg.q @ seg.kv.T * (sc.sm_scale * sc.k_scale)  # [H, L]
    if sc.logit_cap > 0:
        s = sc.logit_cap * torch.tanh(s / sc.logit_cap)
    m = s.amax(-1, keepdim=True)  # [H, 1]
    p = torch.exp(s - m)  # [H, L]
    pts, inv = torch.unique(torch.cat([starts, ends, torch.tensor([0, L])]), return_inverse=True)  # sorted
    i0, i1 = inv[: len(starts)], inv[len(starts) : 2 * len(starts)]  # each range's ends among pts
    Zc = torch.cat([torch.zeros_like(p[:, :1]), p.cumsum(-1)], -1)[:, pts]  # [H, npts] sum p before pts[k]
    blk = torch.bucketize(torch.arange(L), pts[1:], right=True) + 1  # position x counts from point blk[x]
    H, step = p.shape[0], max(1, CHUNK // max(p.shape[0] * Dv, 1))
    Ac = torch.zeros(len(pts), H, Dv, dtype=p.dtype)  # [npts, H, Dv]
    for a in range(0, L, step):
        e = min(a + step, L)
        Ac.index_add_(0, blk[a:e], (p[:, a:e, None] * V[None, a:e]).transpose(0, 1))
    Ac = Ac.cumsum(0)  # sum p v over the positions before pts[k]
    ZcT, E = Zc.T.contiguous(), torch.exp(-m)[:, 0]  # [npts, H], [H]
    out = torch.empty(len(starts), dtype=p.dtype)
    for a in range(0, len(starts), step):
        j0, j1 = i0[a : a + step], i1[a : a + step]
        Z = ZcT[-1][None] - (ZcT[j1] - ZcT[j0])  # [K, H]
        if zero:
            Z += (ends - starts)[a : a + step].to(Z.dtype)[:, None] * E[None]  # zero rows: logit 0
        d = Ac[j1] - Ac[j0]  # [K, H, Dv] the range's part of sum p v
        d -= Ac[-1][None]  # minus the whole: -A
        d /= Z[..., None]
        d += target[None]  # target - A / Z
        err = d.abs().amax(-1) / seg.tol[None]  # [K, H]
        out[a : a + step] = err.nan_to_num(float("inf")).amax(-1)  # [K]
    return out


def _inside(seg: Segment, blk: tuple[int, int]) -> list[tuple[int, int]]:
    """Sub-ranges of a block, shortest first: single positions (all of a short segment's), then
    the block's heads and tails of 2, 4, 8, ... positions."""
    L, (a, e) = seg.kv.shape[0], blk
    every = seg.split is not None and L <= SINGLES  # a split: its last position may be the one
    singles = [(p, p + 1) for p in (range(L) if every else range(a, e))]
    ends, k = [], 2
    while k < e - a:
        ends += [(a, a + k), (e - k, e)]
        k *= 2
    return singles + ends


def _grow(seg: Segment, blk: tuple[int, int], zero: bool, r: float) -> tuple[tuple[int, int], float]:
    """Add the neighbouring block that helps most while the removal does not yet restore (a run
    of pages gone together); stop when no neighbour takes a tenth of the error away."""
    (a, e), L = blk, seg.kv.shape[0]
    step = seg.page_size if seg.page_size > 1 else BLOCK
    while r > 1:
        grown = [x for x in ((max(0, a - step), e), (a, min(L, e + step))) if x != (a, e)]
        scored = [(seg.ratio(x, zero), x) for x in grown]
        if not scored or min(scored)[0] > 0.9 * r:
            break
        r, (a, e) = min(scored)
    return (a, e), r


def _narrow(seg: Segment, a: int, e: int, zero: bool) -> tuple[int, int]:
    """The smallest [a', e') inside [a, e) whose removal still restores: binary search on each end."""
    lo, hi = a, e - 1  # the largest start that still restores
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if seg.ratio((mid, e), zero) <= 1 else (lo, mid - 1)
    a = lo
    lo, hi = a + 1, e  # the smallest end that still restores
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if seg.ratio((a, mid), zero) <= 1 else (mid + 1, hi)
    return a, lo
