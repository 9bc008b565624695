"""Block-sum algebra: every block-aligned range of a request scored at once (kv_range_missing,
split_missing).

The softmax is linear in the set of kept positions. Per block of the granularity (pages, or
32-token split units, plus the kernel's split bounds) the weights Z_k = sum p and the weighted
values A_k = sum p v are summed once; for the observed output o, dropping blocks [i, j) predicts

    o_pred - o = (W - (C_j - C_i)) / (Z - Z_ij)

with C the prefix sums of w_k = A_k - o Z_k and W = A - o Z (zeroed rows add n exp(-max) to the
denominator and o n exp(-max) to w_k). Above a size budget the value axis is randomly projected
to rank the ranges, and only the best few are scored exactly.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

import torch

from refmla import reference as ref
from refmla.nearest import nearest_ranges as nearest_prefix_ranges
from refmla.nearest import projection
from refmla.hypotheses.search import Search
from refmla.schedule import (
    H200_SM_COUNT, MIN_BLOCK_KV, default_num_kv_splits, mla_max_kv_splits, split_bounds, vllm_num_kv_splits,
)  # fmt: skip

PAIR_BUDGET = 2**26  # elements scored exactly per range search; above it, projection ranking
SCORE_CHUNK = 2**19  # values scored at a time: a chunk that stays in cache (5x faster than 2^23)
RANK_WIDTH = 8  # the value axis projected to this many dimensions for :func:`nearest_ranges`


# --------------------------------------------------------------------------------------------
# The kernel's split schedule and the block boundaries
# --------------------------------------------------------------------------------------------


def split_count(s: Search, b: int) -> int:
    """Request b's split count: the capture's num_kv_splits, else the kernel's default for this
    batch (SGLang's get_num_kv_splits; vLLM's batch-wide count for a uniform schedule)."""
    cap = s.cap
    if cap.num_kv_splits is not None:
        return int(cap.num_kv_splits[b])
    if cap.meta.split_schedule == "uniform":
        longest = int(cap.seq_lens.max()) if cap.batch_size else 0
        return vllm_num_kv_splits(longest, int(getattr(s.ctx.opts, "cu_count", 0) or H200_SM_COUNT))

    cu = int(getattr(s.ctx.opts, "cu_count", 256) or 0)
    mx = cap.meta.max_kv_splits or mla_max_kv_splits(cu)
    return int(default_num_kv_splits(cap.seq_lens, max_kv_splits=mx, num_heads=cap.num_heads, cu_count=cu)[b])


def split_schedule(s: Search, b: int) -> Optional[list[tuple[int, int]]]:
    """Non-empty split bounds of request b (decode only), or None when unknown."""
    if not s.cap.is_decode:
        return None
    try:
        n = split_count(s, b)
    except Exception:
        return None
    return [(a, e) for a, e in split_bounds(s.req(b).L, n, s.cap.split_block) if e > a]


def boundaries(s: Search, b: int, Lp: int) -> torch.Tensor:
    """Candidate range ends in [0, Lp]: page multiples (page_size > 1) or 32-token units, plus split bounds."""
    P = s.cap.meta.page_size
    unit = P if P > 1 else MIN_BLOCK_KV
    pts = set(range(0, Lp, unit)) | {0, Lp}
    for a, e in split_schedule(s, b) or []:
        pts |= {min(a, Lp), min(e, Lp)}
    return torch.tensor(sorted(pts), dtype=torch.int64)


# --------------------------------------------------------------------------------------------
# Block sums and range scores
# --------------------------------------------------------------------------------------------


@dataclass
class BlockSums:
    """Softmax pieces of one request summed per block of positions (fp64)."""

    bnd: torch.Tensor  # [nb + 1] block boundaries (positions)
    Zc: torch.Tensor  # [nb + 1, TH] prefix sums of sum p
    Cd: torch.Tensor  # [nb + 1, TH, Dv] prefix sums of w (dropped)
    Cz: torch.Tensor  # [nb + 1, TH, Dv] prefix sums of w + o n exp(-m) (zeroed)
    W: torch.Tensor  # [TH, Dv] A - o Z over everything attended
    Z: torch.Tensor  # [TH]
    E: torch.Tensor  # [TH] exp(-m): weight of one all-zero row
    tol: torch.Tensor  # [TH] allowed error per row
    projected: bool = False  # value axis randomly projected (ranking only)


@dataclass(order=True)
class BlockRange:
    """Blocks [i, j) of a request's boundaries and the screening ratio of dropping / zeroing them."""

    score: float
    i: int
    j: int


def searchable(s: Search, b: int) -> int:
    """Positions of request b a range may cover: the cache (decode) / the prefix (extend)."""
    r = s.req(b)
    return r.L if s.cap.is_decode else r.L - r.T


def block_sums(
    s: Search, b: int, sc: ref.Scales, bnd: Optional[torch.Tensor] = None, proj: Optional[torch.Tensor] = None
) -> Optional[BlockSums]:
    """Request b's softmax pieces summed per block of ``bnd`` (default :func:`boundaries`); with
    ``proj`` [Dv, w] the value axis projected first (``projected``: a ranking, at w / Dv the cost)."""
    r = s.req(b)
    Lp = searchable(s, b)
    if Lp < 1:
        return None
    T, H, Dv = r.T, r.q64.shape[1], sc.kv_lora_rank
    S = r.raw * sc.sm_scale  # [T, H, L]
    if sc.logit_cap > 0:
        S = sc.logit_cap * torch.tanh(S / sc.logit_cap)
    visible = r.visible()  # [T, L]
    S = S.masked_fill(~visible[:, None, :], -math.inf)
    m = S.amax(-1)  # [T, H]
    P = torch.exp(S - m[..., None]).reshape(T * H, r.L)  # [TH, L]
    V = r.kv64[:, :Dv] * sc.v_scale  # [L, Dv]
    o = s.o64[r.rows].reshape(T * H, Dv)  # [TH, Dv]
    if proj is not None:
        V, o, Dv = V @ proj, o @ proj, proj.shape[1]
    bnd = boundaries(s, b, Lp) if bnd is None else bnd
    nb = len(bnd) - 1
    blk = torch.bucketize(torch.arange(Lp), bnd[1:], right=True)  # [Lp] block of each position
    Zb = torch.zeros(T * H, nb, dtype=torch.float64).index_add_(1, blk, P[:, :Lp]).T  # [nb, TH]
    Ab = torch.zeros(T * H, nb, Dv, dtype=torch.float64)  # [TH, nb, Dv]
    step = max(1, SCORE_CHUNK // max(T * H * Dv, 1))
    for a in range(0, Lp, step):  # segment sums of p v, a chunk of positions at a time
        e = min(a + step, Lp)
        Ab.index_add_(1, blk[a:e], P[:, a:e, None] * V[None, a:e])
    Ab = Ab.transpose(0, 1)  # [nb, TH, Dv]
    Z = Zb.sum(0) + P[:, Lp:].sum(-1)  # [TH] with the fixed (new-token) part
    A = Ab.sum(0) + P[:, Lp:] @ V[Lp:]  # [TH, Dv]
    E = torch.exp(-m).reshape(T * H)  # [TH]
    cnt = (bnd[1:] - bnd[:-1]).double()  # [nb]
    w = Ab - o[None] * Zb[..., None]  # [nb, TH, Dv]
    wz = w + o[None] * (cnt[:, None] * E[None])[..., None]
    zero = torch.zeros(1, T * H, Dv, dtype=torch.float64)
    return BlockSums(
        bnd=bnd, Zc=torch.cat([torch.zeros(1, T * H, dtype=torch.float64), Zb.cumsum(0)]),
        Cd=torch.cat([zero, w.cumsum(0)]), Cz=torch.cat([zero, wz.cumsum(0)]),
        W=A - o * Z[:, None], Z=Z, E=E, tol=s.row_tol[r.rows].reshape(T * H), projected=proj is not None,
    )  # fmt: skip


def score_pairs(bs: BlockSums, starts: torch.Tensor, ends: torch.Tensor, zeroed: bool) -> torch.Tensor:
    """Screening ratio of dropping / zeroing blocks [starts, ends): max over rows of err / allowed. [K]

    With the value axis projected (:func:`project`), err is the RMS over the projection instead of
    the max over Dv: a ranking, not a verdict.
    """
    C = bs.Cz if zeroed else bs.Cd
    out = torch.empty(len(starts), dtype=torch.float64)
    TH, width = bs.W.shape
    step = max(1, SCORE_CHUNK // max(TH * width, 1))
    for a in range(0, len(starts), step):
        i, j = starts[a : a + step], ends[a : a + step]
        D = C[j]  # [k, TH, width] (a gathered copy: updated in place)
        D -= C[i]
        D -= bs.W[None]
        err = torch.linalg.vector_norm(D, dim=-1) / math.sqrt(width) if bs.projected else D.abs().amax(-1)  # [k, TH]
        den = bs.Z[None] - (bs.Zc[j] - bs.Zc[i])
        if zeroed:
            den = den + (bs.bnd[j] - bs.bnd[i]).to(den.dtype)[:, None] * bs.E[None]
        ratio = (err / den.abs()) / bs.tol[None]
        out[a : a + step] = torch.nan_to_num(ratio, nan=math.inf).amax(-1)
    return out


def project(bs: BlockSums, width: int) -> BlockSums:
    """The same sums with the value axis randomly projected to ``width`` (the sums are linear in it)."""
    proj = projection(bs.W.shape[1], width)
    f = torch.float32  # ranking precision is plenty
    cd, cz, w = (bs.Cd @ proj).to(f), (bs.Cz @ proj).to(f), (bs.W @ proj).to(f)
    low = {k: getattr(bs, k).to(f) for k in ("Zc", "Z", "E", "tol")}
    return dataclasses.replace(bs, Cd=cd, Cz=cz, W=w, projected=True, **low)


def best_pairs(bs: BlockSums, zeroed: bool, exclude: set[tuple[int, int]], top: int) -> list[BlockRange]:
    """The ``top`` best block ranges [i, j), i < j, exactly scored, best first."""
    nb = len(bs.bnd) - 1
    starts, ends = torch.triu_indices(nb + 1, nb + 1, offset=1)
    if exclude:
        drop = torch.tensor([i * (nb + 1) + j for i, j in exclude], dtype=torch.int64)
        keep = ~torch.isin(starts * (nb + 1) + ends, drop)
        starts, ends = starts[keep], ends[keep]
    return best_of(bs, starts, ends, zeroed, top)


def best_of(
    bs: BlockSums, starts: torch.Tensor, ends: torch.Tensor, zeroed: bool, top: int, budget: int = PAIR_BUDGET
) -> list[BlockRange]:
    """The ``top`` best of the block ranges [starts[k], ends[k]), exactly scored, best first.

    Every range is scored from the prefix sums; past ``budget`` values the value axis is first
    projected to rank them, and only the best few are scored exactly.
    """
    if len(starts) == 0:
        return []
    TH, Dv = bs.W.shape
    if len(starts) * TH * Dv > budget:
        width = max(4, min(Dv, 16, budget // max(len(starts) * TH, 1)))
        order = torch.argsort(score_pairs(project(bs, width), starts, ends, zeroed))[: max(64, 8 * top)]
        starts, ends = starts[order], ends[order]
    scores = score_pairs(bs, starts, ends, zeroed)
    order = torch.argsort(scores)[:top]
    return [BlockRange(float(scores[o]), int(starts[o]), int(ends[o])) for o in order]


def nearest_ranges(fp: BlockSums, zeroed: bool, keep: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ``keep`` ranges [i, j) of ``fp``'s boundaries (block sums with the value axis projected)
    whose dropping (zeroing) lies nearest the output, of every range at once, nearest first, with
    each one's squared distance: dropping [i, j) fits when C_j - C_i = W up to noise, so the points
    C_i + W and C_j are near (each row scaled by 1 / (Z tol), the denominator taken as Z: a
    ranking), one GEMM (refmla.nearest). Each range's exact score is :func:`best_of`'s.

    A range within the screen (every error at most SCREEN allowances) lies within about
    SCREEN^2 * TH * width * Dv of its point (a projected coordinate of an error e has variance
    |e|^2 <= Dv max|e|^2): :func:`beyond_screen`."""
    C = fp.Cz if zeroed else fp.Cd  # [nb + 1, TH, w]
    scale = (1 / (fp.Z * fp.tol))[:, None]  # [TH, 1]
    return nearest_prefix_ranges((C * scale[None]).flatten(1), (fp.W * scale).flatten(), keep)


def beyond_screen(d: torch.Tensor, fp: BlockSums, Dv: int, screen: float) -> bool:
    """True when even the nearest range (squared distance ``d[0]``, :func:`nearest_ranges`) lies
    past four times the distance a range within the screen can have: none passes, skip it."""
    TH, w = fp.W.shape
    return len(d) == 0 or float(d[0]) > 4 * screen**2 * TH * w * Dv


def window_pairs(bnd: list[int], p0: int, p1: int, radius: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices into ``bnd`` of every range [a, e), a < e, with a within ``radius`` of p0 and e of p1."""
    pos = {p: i for i, p in enumerate(bnd)}
    lo = torch.tensor([pos[p] for p in bnd if abs(p - p0) <= radius])
    hi = torch.tensor([pos[p] for p in bnd if abs(p - p1) <= radius])
    starts, ends = lo.repeat_interleave(len(hi)), hi.repeat(len(lo))
    keep = starts < ends
    return starts[keep], ends[keep]
