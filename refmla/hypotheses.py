"""Hypotheses for a diverging output (CONTRACT section 4): replay the reference under each, report
the first, in the table's order, that brings the backend's error back to rounding noise.

    seq_len_off_by      {"delta": k}                  attended seq_len + k tokens, k in -4..4, k != 0
    kv_range_missing    {"start", "end", "how"}       positions [start, end) dropped or read as zeros,
                                                      at page or split granularity
    split_missing       {"split": s}                  split s's partial left out of the merge
    wrong_sm_scale      {"ratio": r}                  used r * sm_scale
    head_misaligned     {"mapping": "...", "heads"}   output head h holds reference head heads[h]
    logit_cap_mismatch  {"logit_cap": c}              soft cap c applied (0: omitted)

"Back to rounding noise" is the comparator itself (refmla.compare.compare, the replay's
tolerance) against the reference *and the low-precision control* recomputed under the
hypothesis, so a hypothesis is never judged against the noise of different math. Per-request
hypotheses change only the failing requests, each with its own detail, and must still pass every
other row; the report names the worst request and lists the others under ``requests``.

How it stays fast (8 requests x 1300 tokens x 8 heads: tools/bench_explain.py):

* Only failing requests are recomputed, worst first; a per-request hypothesis that cannot explain
  the worst request is abandoned at once.
* Ranges: the softmax is linear in the set of kept positions. Per block of the granularity
  (pages, or 32-token split units, plus the split bounds) the weights Z_k = sum p and the weighted
  values A_k = sum p v are summed once; for the observed output o, dropping [i, j) predicts
  o_pred - o = (W - (C_j - C_i)) / (Z - Z_ij), with C the prefix sums of w_k = A_k - o Z_k and
  W = A - o Z (zeroed rows add n exp(-max) to the denominator and o n exp(-max) to w_k). Every
  block-aligned range of a request is scored at once from these prefix sums; above a size budget
  the value axis is randomly projected to rank candidates and only the best few are scored exactly.
* Scale and soft cap: candidates derived from the meta (no yarn mscale^2, mscale once, 1/sqrt(D)
  for the usual D, exp vs exp2, the common caps), then a 1-D fit on the worst request (log grid,
  golden section), each confirmed on the whole output.
* Heads: each output head is matched to its nearest reference head over all rows.

A dropped range that is exactly one split of the kernel's schedule is left to ``split_missing``:
dropping a split's partial from the merge and dropping its positions are the same arithmetic,
and the split names the mechanism.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

import torch

from refmla import reference as ref
from refmla.control import attend_control, mla_control, mla_decode_split_control
from refmla.compare import Comparison, compare, cos_diff, judged_dtype
from refmla.schedule import MIN_BLOCK_KV, default_num_kv_splits, mla_max_kv_splits, split_bounds
from refmla.util import single_thread

HYPOTHESES = (
    "seq_len_off_by",
    "kv_range_missing",
    "split_missing",
    "wrong_sm_scale",
    "head_misaligned",
    "logit_cap_mismatch",
)
DELTAS = (-1, 1, -2, 2, -3, 3, -4, 4)  # simplest first
SCREEN = 4.0  # a candidate is confirmed only if its screening ratio (err / allowed) is below this
GOOD = 1.5  # a named candidate screening this well is confirmed before any fit is tried
FIT_HEADS = 2  # rows (token, head) of the worst request a 1-D fit looks at
CONFIRM_TOP = 3  # candidates confirmed per request / per global hypothesis before giving up
PAIR_BUDGET = 2**26  # elements scored exactly per range search; above it, projection ranking
LOG2E = 1.0 / math.log(2.0)


# --------------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------------


def explain_failure(ctx, out: torch.Tensor, cmp: Comparison) -> Optional[dict]:
    """The simplest hypothesis that explains a failing output, or None.

    ctx: refmla.replay.ReplayContext; out: the backend's output [R, H, Dv]; cmp: its comparison.
    Returns {"hypothesis", "request", "detail", "max_abs_err", ...} (CONTRACT section 3 / 4).
    """
    t0 = time.perf_counter()
    if cmp.row_err is None or tuple(out.shape) != tuple(ctx.ref_out.shape):
        return None
    with single_thread(), torch.no_grad():
        s = Search(ctx, out, cmp)
        if not s.failing:
            return None
        for name in HYPOTHESES:
            res = SEARCHES[name](s)
            if res is not None:
                res["seconds"] = round(time.perf_counter() - t0, 3)
                return res
    return None


# --------------------------------------------------------------------------------------------
# Shared state
# --------------------------------------------------------------------------------------------


@dataclass
class Req:
    """One request's pieces in fp64, built once."""

    b: int
    rows: torch.Tensor  # [T] rows of `out` (decode: [b]; extend: its tokens)
    pool_rows: torch.Tensor  # [L] pool rows in position order
    q64: torch.Tensor  # [T, H, D]
    kv64: torch.Tensor  # [L, D]
    raw: torch.Tensor  # [T, H, L] q . k * k_scale (no sm_scale, no cap)
    vis: torch.Tensor  # [T] positions each token attends (decode: L)
    kvs: Optional[torch.Tensor] = None  # [L, D] in the stored dtype, gathered on first use

    @property
    def T(self) -> int:
        return len(self.rows)

    @property
    def L(self) -> int:
        return len(self.pool_rows)


@dataclass
class Candidate:
    detail: dict
    expected: torch.Tensor  # fp64, the request's rows [T, H, Dv] or the whole output [R, H, Dv]
    control: torch.Tensor  # same shape, in the compare dtype
    score: float = math.inf
    extra: dict = field(default_factory=dict)


class Search:
    """What every hypothesis search of one failing output shares."""

    def __init__(self, ctx, out: torch.Tensor, cmp: Comparison):
        cap = ctx.cap
        self.ctx, self.cap, self.cmp = ctx, cap, cmp
        self.sc = ref.Scales(**cap.scales())
        self.dtype = judged_dtype(out.dtype)
        self.out = out.detach().cpu()
        self.o64 = self.out.double()  # [R, H, Dv]
        self.ref = ctx.ref_out  # [R, H, Dv] fp64
        self.ctrl = ctx.control(self.dtype)  # [R, H, Dv]
        self.tol = ctx.opts.tol
        self.req_of_row = cap.request_of_row()  # [R]
        R, H = self.o64.shape[0], self.o64.shape[1]
        self.mask = None if cmp.compared_rows >= R * H else ~ctx.empty_rows()  # as the replay compared
        self.row_tol = cmp.row_tol.clamp(min=1e-300)  # [R, H]
        ratio = self.row_ratio(self.o64, self.ref)  # [R, H]
        bad = ratio > 1
        bad |= self._nan_rows() | self._cos_rows()
        if self.mask is not None:
            bad &= self.mask[:, None]
        self.bad_rows = bad  # [R, H]
        worst = torch.where(bad, ratio, torch.zeros_like(ratio)).amax(-1)  # [R]
        per_req: dict[int, float] = {}
        for r in torch.nonzero(bad.any(-1)).flatten().tolist():
            b = int(self.req_of_row[r])
            per_req[b] = max(per_req.get(b, 0.0), float(worst[r]))
        self.failing = sorted(per_req, key=lambda b: -per_req[b])  # worst first
        self.worst_request = self.failing[0] if self.failing else None
        self._reqs: dict[int, Req] = {}

    # -- row measures ------------------------------------------------------------------------

    def row_ratio(self, o64: torch.Tensor, expected: torch.Tensor, rows: Optional[torch.Tensor] = None) -> torch.Tensor:
        """max |o - expected| / allowed per (row, head); NaN/Inf where they differ -> inf."""
        tol = self.row_tol if rows is None else self.row_tol[rows]
        d = (o64 - expected).abs()
        same = (torch.isnan(o64) == torch.isnan(expected)) & (torch.isinf(o64) == torch.isinf(expected))
        d = torch.where(torch.isfinite(d), d, torch.where(same, torch.zeros_like(d), torch.full_like(d, math.inf)))
        return d.amax(-1) / tol

    def _nan_rows(self) -> torch.Tensor:
        a, e = self.o64, self.ref
        return ((torch.isnan(a) != torch.isnan(e)) | (torch.isinf(a) != torch.isinf(e))).any(-1)

    def _cos_rows(self) -> torch.Tensor:
        fin = torch.isfinite(self.o64) & torch.isfinite(self.ref)
        a, e = torch.where(fin, self.o64, 0), torch.where(fin, self.ref, 0)
        c = self.ctrl.double()
        ctl = cos_diff(torch.where(fin, c, 0), e, dim=-1)
        return cos_diff(a, e, dim=-1) > torch.clamp(self.tol.k**2 * ctl, min=self.tol.cos)

    def rows_of(self, b: int) -> torch.Tensor:
        return torch.nonzero(self.req_of_row == b).flatten()

    def heads_failing(self, b: int) -> list[int]:
        return torch.nonzero(self.bad_rows[self.rows_of(b)].any(0)).flatten().tolist()

    # -- per-request pieces ------------------------------------------------------------------

    def req(self, b: int) -> Req:
        if b not in self._reqs:
            cap = self.cap
            rows = self.rows_of(b)
            pool_rows = ref.request_rows(cap.kv_indptr, cap.kv_indices, b)
            L, T = len(pool_rows), len(rows)
            q64 = cap.q[rows].double()  # [T, H, D]
            kv64 = ref.gather(cap.kv_buffer, pool_rows, torch.float64)  # [L, D]
            raw = torch.einsum("thd,ld->thl", q64, kv64) * self.sc.k_scale  # [T, H, L]
            vis = torch.arange(T) + (L - T + 1)  # token t sees L - T + t + 1 positions
            self._reqs[b] = Req(b, rows, pool_rows, q64, kv64, raw, vis)
        return self._reqs[b]

    def attend_rows(
        self,
        b: int,
        seq_rows: torch.Tensor,
        vis: torch.Tensor,
        keep: Optional[torch.Tensor] = None,
        zero: Optional[torch.Tensor] = None,
        sc: Optional[ref.Scales] = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Reference (fp64) and control (compare dtype) of request b's rows under a modified sequence.

        seq_rows [S] pool rows in position order; token t attends positions [0, vis[t]) that are in
        ``keep`` (default all), rows in ``zero`` read as all-zero.
        """
        sc = sc or self.sc
        r = self.req(b)
        if seq_rows is r.pool_rows:  # the request's own rows: gathered once
            if r.kvs is None:
                r.kvs = ref.gather(self.cap.kv_buffer, seq_rows, self.cap.kv_buffer.dtype)
            kv64, kvs = r.kv64, r.kvs
        else:
            kv64 = ref.gather(self.cap.kv_buffer, seq_rows, torch.float64)  # [S, D]
            kvs = ref.gather(self.cap.kv_buffer, seq_rows, self.cap.kv_buffer.dtype)  # stored dtype
        if zero is not None and bool(zero.any()):
            kv64, kvs = kv64.clone(), kvs.clone()
            kv64[zero], kvs[zero] = 0, 0
        H, Dv = r.q64.shape[1], sc.kv_lora_rank
        exp = torch.empty(r.T, H, Dv, dtype=torch.float64)
        ctl = torch.empty(r.T, H, Dv, dtype=self.dtype)
        for t in range(r.T):
            sel = torch.arange(int(vis[t]))
            if keep is not None:
                sel = sel[keep[sel]]
            exp[t] = ref.attend(r.q64[t], kv64[sel], sc)[0]
            ctl[t] = attend_control(self.cap.q[r.rows[t]], kvs[sel], sc, self.dtype)[0]
        return exp, ctl

    # -- confirmation ------------------------------------------------------------------------

    def confirm(self, expected: torch.Tensor, control: torch.Tensor, rows: Optional[torch.Tensor] = None) -> Comparison:
        """The comparator on the whole output, or on ``rows`` only."""
        if rows is None:
            return compare("hypothesis", self.out, expected, control, out_dtype=self.dtype, tol=self.tol,
                           row_mask=self.mask, request_of_row=self.req_of_row)  # fmt: skip
        mask = None if self.mask is None else self.mask[rows]
        return compare("hypothesis", self.out[rows], expected, control, out_dtype=self.dtype, tol=self.tol,
                       row_mask=mask, request_of_row=self.req_of_row[rows])  # fmt: skip

    def result(self, name: str, detail: dict, cmp: Comparison, request: Optional[int] = None, **extra) -> dict:
        b = self.worst_request if request is None else request
        ratio = cmp.row_err / cmp.row_tol if cmp.row_err is not None else None
        return {
            "hypothesis": name,
            "request": b,
            "detail": detail,
            "max_abs_err": cmp.max_abs_err,
            "residual_ratio": float(ratio.max()) if ratio is not None and ratio.numel() else 0.0,
            "heads": self.heads_failing(b),
            **extra,
        }


# --------------------------------------------------------------------------------------------
# Drivers
# --------------------------------------------------------------------------------------------


def per_request(s: Search, name: str, finder: Callable[[Search, int], Iterator[Candidate]]) -> Optional[dict]:
    """Explain every failing request (worst first, each its own detail), then confirm them together."""
    found: dict[int, Candidate] = {}
    for b in s.failing:
        rows = s.rows_of(b)
        for i, cand in enumerate(finder(s, b)):
            if i >= CONFIRM_TOP:
                break
            if s.confirm(cand.expected, cand.control, rows).passed:
                found[b] = cand
                break
        if b not in found:
            return None
    expected, control = s.ref.clone(), s.ctrl.clone()
    for b, cand in found.items():
        rows = s.rows_of(b)
        expected[rows], control[rows] = cand.expected, cand.control
    cmp = s.confirm(expected, control)
    if not cmp.passed:
        return None
    worst = found[s.worst_request]
    extra = dict(worst.extra)
    if len(found) > 1:
        extra["requests"] = [{"request": b, "detail": c.detail} for b, c in found.items()]
    return s.result(name, worst.detail, cmp, scope="request", **extra)


def global_hypothesis(s: Search, name: str, candidates: Iterator[Candidate]) -> Optional[dict]:
    """Confirm whole-output candidates, best first."""
    for i, cand in enumerate(candidates):
        if i >= CONFIRM_TOP:
            break
        cmp = s.confirm(cand.expected, cand.control)
        if cmp.passed:
            return s.result(name, cand.detail, cmp, scope="all requests", **cand.extra)
    return None


def rescore(s: Search, b: int, expected: torch.Tensor) -> float:
    """Screening ratio of request b's rows against a candidate's fp64 expectation."""
    rows = s.rows_of(b)
    r = s.row_ratio(s.o64[rows], expected, rows)
    if s.mask is not None:
        r = r[s.mask[rows]]
    return float(r.max()) if r.numel() else 0.0


# --------------------------------------------------------------------------------------------
# seq_len_off_by
# --------------------------------------------------------------------------------------------


def extra_rows(s: Search, b: int, k: int) -> Optional[torch.Tensor]:
    """The k pool rows after request b's last position, or None when the capture cannot say.

    req_to_token[b, L:L+k] when the capture has them; else the next slots of the last page when
    page_size > 1 and they stay inside it.
    """
    cap, r = s.cap, s.req(b)
    L, N = r.L, cap.kv_buffer.shape[0]
    if cap.req_to_token is not None and cap.req_to_token.shape[1] >= L + k:
        nxt = cap.req_to_token[b, L : L + k].long()
        if bool(((nxt >= 0) & (nxt < N)).all()):
            return nxt
    P = cap.meta.page_size
    if P > 1 and L > 0:
        last = int(r.pool_rows[-1])
        if last % P + k < P and last + k < N:
            return torch.arange(last + 1, last + k + 1)
    return None


def find_seq_len(s: Search, b: int) -> Iterator[Candidate]:
    r = s.req(b)
    cands = []
    for k in DELTAS:
        if k < 0 and int(r.vis.min()) + k < 0:
            continue
        seq = r.pool_rows
        if k > 0:
            nxt = extra_rows(s, b, k)
            if nxt is None:
                continue
            seq = torch.cat([seq, nxt])
        exp, ctl = s.attend_rows(b, seq, r.vis + k)
        cands.append(Candidate({"delta": k}, exp, ctl, rescore(s, b, exp)))
    yield from sorted((c for c in cands if c.score < SCREEN), key=lambda c: c.score)


def search_seq_len(s: Search) -> Optional[dict]:
    return per_request(s, "seq_len_off_by", find_seq_len)


# --------------------------------------------------------------------------------------------
# kv_range_missing and split_missing
# --------------------------------------------------------------------------------------------


def split_count(s: Search, b: int) -> int:
    """Request b's split count: the capture's num_kv_splits, else SGLang's default for this batch."""
    cap = s.cap
    if cap.num_kv_splits is not None:
        return int(cap.num_kv_splits[b])

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
    return [(a, e) for a, e in split_bounds(s.req(b).L, n) if e > a]


def boundaries(s: Search, b: int, Lp: int) -> torch.Tensor:
    """Candidate range ends in [0, Lp]: page multiples (page_size > 1) or 32-token units, plus split bounds."""
    P = s.cap.meta.page_size
    unit = P if P > 1 else MIN_BLOCK_KV
    pts = set(range(0, Lp, unit)) | {0, Lp}
    for a, e in split_schedule(s, b) or []:
        pts |= {min(a, Lp), min(e, Lp)}
    return torch.tensor(sorted(pts), dtype=torch.int64)


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


def block_sums(s: Search, b: int, sc: ref.Scales) -> Optional[BlockSums]:
    r = s.req(b)
    Lp = r.L if s.cap.is_decode else r.L - r.T  # searchable: the cache (decode) / the prefix (extend)
    if Lp < 1:
        return None
    T, H, Dv = r.T, r.q64.shape[1], sc.kv_lora_rank
    S = r.raw * sc.sm_scale  # [T, H, L]
    if sc.logit_cap > 0:
        S = sc.logit_cap * torch.tanh(S / sc.logit_cap)
    visible = torch.arange(r.L)[None, :] < r.vis[:, None]  # [T, L]
    S = S.masked_fill(~visible[:, None, :], -math.inf)
    m = S.amax(-1)  # [T, H]
    P = torch.exp(S - m[..., None]).reshape(T * H, r.L)  # [TH, L]
    V = r.kv64[:, :Dv] * sc.v_scale  # [L, Dv]
    bnd = boundaries(s, b, Lp)
    nb = len(bnd) - 1
    blk = torch.bucketize(torch.arange(Lp), bnd[1:], right=True)  # [Lp] block of each position
    Zb = torch.zeros(T * H, nb, dtype=torch.float64).index_add_(1, blk, P[:, :Lp]).T  # [nb, TH]
    Ab = torch.zeros(T * H, nb, Dv, dtype=torch.float64)  # [TH, nb, Dv]
    step = max(1, 2**22 // max(T * H * Dv, 1))
    for a in range(0, Lp, step):  # segment sums of p v, a chunk of positions at a time
        e = min(a + step, Lp)
        Ab.index_add_(1, blk[a:e], P[:, a:e, None] * V[None, a:e])
    Ab = Ab.transpose(0, 1)  # [nb, TH, Dv]
    Z = Zb.sum(0) + P[:, Lp:].sum(-1)  # [TH] with the fixed (new-token) part
    A = Ab.sum(0) + P[:, Lp:] @ V[Lp:]  # [TH, Dv]
    o = s.o64[r.rows].reshape(T * H, Dv)  # [TH, Dv]
    E = torch.exp(-m).reshape(T * H)  # [TH]
    cnt = (bnd[1:] - bnd[:-1]).double()  # [nb]
    w = Ab - o[None] * Zb[..., None]  # [nb, TH, Dv]
    wz = w + o[None] * (cnt[:, None] * E[None])[..., None]
    zero = torch.zeros(1, T * H, Dv, dtype=torch.float64)
    return BlockSums(
        bnd=bnd, Zc=torch.cat([torch.zeros(1, T * H, dtype=torch.float64), Zb.cumsum(0)]),
        Cd=torch.cat([zero, w.cumsum(0)]), Cz=torch.cat([zero, wz.cumsum(0)]),
        W=A - o * Z[:, None], Z=Z, E=E, tol=s.row_tol[r.rows].reshape(T * H),
    )  # fmt: skip


def score_pairs(bs: BlockSums, starts: torch.Tensor, ends: torch.Tensor, zeroed: bool) -> torch.Tensor:
    """Screening ratio of dropping / zeroing blocks [starts, ends): max over rows of err / allowed. [K]

    With the value axis projected (:func:`project`), err is the RMS over the projection instead of
    the max over Dv: a ranking, not a verdict.
    """
    C = bs.Cz if zeroed else bs.Cd
    out = torch.empty(len(starts), dtype=torch.float64)
    TH, width = bs.W.shape
    step = max(1, PAIR_BUDGET // 8 // max(TH * width, 1))
    for a in range(0, len(starts), step):
        i, j = starts[a : a + step], ends[a : a + step]
        D = C[j] - C[i] - bs.W[None]  # [k, TH, width]
        err = D.norm(dim=-1) / math.sqrt(width) if bs.projected else D.abs().amax(-1)  # [k, TH]
        den = bs.Z[None] - (bs.Zc[j] - bs.Zc[i])
        if zeroed:
            den = den + (bs.bnd[j] - bs.bnd[i]).to(den.dtype)[:, None] * bs.E[None]
        ratio = (err / den.abs()) / bs.tol[None]
        out[a : a + step] = torch.nan_to_num(ratio, nan=math.inf).amax(-1)
    return out


def project(bs: BlockSums, width: int) -> BlockSums:
    """The same sums with the value axis randomly projected to ``width`` (the sums are linear in it)."""
    g = torch.Generator().manual_seed(0)
    proj = torch.randn(bs.W.shape[1], width, generator=g, dtype=torch.float64)
    f = torch.float32  # ranking precision is plenty
    cd, cz, w = (bs.Cd @ proj).to(f), (bs.Cz @ proj).to(f), (bs.W @ proj).to(f)
    low = {k: getattr(bs, k).to(f) for k in ("Zc", "Z", "E", "tol")}
    return dataclasses.replace(bs, Cd=cd, Cz=cz, W=w, projected=True, **low)


def best_pairs(bs: BlockSums, zeroed: bool, exclude: set, top: int) -> list[tuple[float, int, int]]:
    """The ``top`` best block ranges (score, i, j), i < j, exactly scored.

    Every range is scored from the prefix sums; past PAIR_BUDGET values the value axis is first
    projected to rank them, and only the best few are scored exactly.
    """
    nb = len(bs.bnd) - 1
    starts, ends = torch.triu_indices(nb + 1, nb + 1, offset=1)
    if exclude:
        drop = torch.tensor([i * (nb + 1) + j for i, j in exclude], dtype=torch.int64)
        keep = ~torch.isin(starts * (nb + 1) + ends, drop)
        starts, ends = starts[keep], ends[keep]
    if len(starts) == 0:
        return []
    TH, Dv = bs.W.shape
    if len(starts) * TH * Dv > PAIR_BUDGET:
        width = max(4, min(Dv, 16, PAIR_BUDGET // max(len(starts) * TH, 1)))
        order = torch.argsort(score_pairs(project(bs, width), starts, ends, zeroed))[: max(64, 8 * top)]
        starts, ends = starts[order], ends[order]
    scores = score_pairs(bs, starts, ends, zeroed)
    order = torch.argsort(scores)[:top]
    return [(float(scores[o]), int(starts[o]), int(ends[o])) for o in order]


def find_range(s: Search, b: int) -> Iterator[Candidate]:
    """Block-aligned ranges of request b, best first, each confirmed as dropped and as zeroed."""
    bs = block_sums(s, b, s.sc)
    if bs is None:
        return
    r = s.req(b)
    rows = s.rows_of(b)
    splits = split_schedule(s, b) or []
    bnd = bs.bnd.tolist()
    pos = {p: i for i, p in enumerate(bnd)}
    split_pairs = {(pos[a], pos[e]) for a, e in splits if a in pos and e in pos} if len(splits) > 1 else set()
    whole = (0, len(bnd) - 1)
    ranked = best_pairs(bs, False, split_pairs | {whole}, CONFIRM_TOP) + best_pairs(bs, True, set(), CONFIRM_TOP)
    seen: set = set()
    P = s.cap.meta.page_size
    granularity = (
        f"{'pages' if P > 1 else 'split units'} of {P if P > 1 else MIN_BLOCK_KV} positions, and split bounds"
    )
    for score, i, j in sorted(ranked):
        if score >= SCREEN or len(seen) >= 2 * CONFIRM_TOP:
            break
        if (i, j) in seen:
            continue
        seen.add((i, j))
        p0, p1 = bnd[i], bnd[j]
        span = (torch.arange(r.L) >= p0) & (torch.arange(r.L) < p1)
        variants = {}
        if (i, j) != whole:
            variants["dropped"] = s.attend_rows(b, r.pool_rows, r.vis, keep=~span)
        variants["zeroed"] = s.attend_rows(b, r.pool_rows, r.vis, zero=span)
        ok = [how for how, (exp, ctl) in variants.items() if s.confirm(exp, ctl, rows).passed]
        if not ok or ((i, j) in split_pairs and "dropped" in ok):
            continue  # nothing explained, or exactly a dropped split: split_missing names it
        exp, ctl = variants[ok[0]]
        extra = {"granularity": granularity}
        if len(ok) == 2:
            mass = float(((p1 - p0) * bs.E / bs.Z).max())
            extra["note"] = (f"dropped and zeroed are indistinguishable here: the zero rows would carry at most "
                             f"{mass:.2g} of the softmax mass")  # fmt: skip
        yield Candidate({"start": p0, "end": p1, "how": " or ".join(ok)}, exp, ctl, score, extra=extra)


def search_range(s: Search) -> Optional[dict]:
    return per_request(s, "kv_range_missing", find_range)


def find_split(s: Search, b: int) -> Iterator[Candidate]:
    cap = s.cap
    splits = split_schedule(s, b)
    if not splits or len(splits) < 2:
        return
    bs = block_sums(s, b, s.sc)
    bnd = bs.bnd.tolist()
    pos = {p: i for i, p in enumerate(bnd)}
    starts = torch.tensor([pos[a] for a, _ in splits])
    ends = torch.tensor([pos[e] for _, e in splits])
    scores = score_pairs(bs, starts, ends, zeroed=False)
    r = s.req(b)
    n = torch.tensor([split_count(s, b)], dtype=torch.int32)
    indptr = torch.tensor([0, r.L])
    partials = None
    for k in torch.argsort(scores).tolist():  # k: split index (non-empty splits come first)
        if float(scores[k]) >= SCREEN:
            break
        if partials is None:  # the merge itself, as the Triton stage 2 does it: every split but k
            args = (cap.q[b : b + 1], cap.kv_buffer, indptr, r.pool_rows, n)
            partials = (ref.mla_decode_split_ref(*args, **cap.scales()),
                        mla_decode_split_control(*args, **cap.scales()))  # fmt: skip
        (parts, lses, valid), (cparts, clses, _) = partials
        valid = valid.clone()
        valid[0, k] = False
        exp = ref.merge_splits(parts, lses, valid)[0]  # [1, H, Dv]
        ctl = ref.merge_splits(cparts.double(), clses.double(), valid)[0].to(s.dtype)
        a, e = splits[k]
        source = "capture" if cap.num_kv_splits is not None else "SGLang Triton default (computed)"
        yield Candidate({"split": k}, exp, ctl, float(scores[k]),
                        extra={"positions": [a, e], "num_kv_splits": int(n[0]), "schedule": source})  # fmt: skip


def search_split(s: Search) -> Optional[dict]:
    if not s.cap.is_decode:
        return None
    return per_request(s, "split_missing", find_split)


# --------------------------------------------------------------------------------------------
# Whole-output hypotheses: scale, heads, soft cap
# --------------------------------------------------------------------------------------------


def full_under(s: Search, sc: ref.Scales) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference (fp64) and control of the whole capture under other scales."""
    cap = s.cap
    args = (cap.q, cap.kv_buffer, cap.kv_indptr, cap.kv_indices)
    kw = dataclasses.asdict(sc)
    qo = None if cap.is_decode else cap.qo_indptr
    if cap.is_decode:
        exp = ref.mla_decode_ref(*args, **kw)[0]
    else:
        exp = ref.mla_extend_ref(*args, qo, **kw)[0]
    splits = cap.num_kv_splits if cap.is_decode else None  # as ReplayContext.control
    ctl = mla_control(*args, **kw, out_dtype=s.dtype, qo_indptr=qo, num_kv_splits=splits)[0]
    return exp, ctl


def worst_out(s: Search, scale: float, cap: float, fit: bool = False) -> torch.Tensor:
    """Output of the worst request under (sm_scale, logit_cap), fp32 inside: [T, H, Dv] fp64.

    With ``fit``, only its FIT_HEADS worst (token, head) rows: [k, Dv] (what a 1-D fit looks at).
    """
    r = s.req(s.worst_request)
    if not hasattr(r, "raw32"):
        visible = torch.arange(r.L)[None, :] < r.vis[:, None]  # [T, L]
        r.raw32 = r.raw.float().masked_fill(~visible[:, None, :], -math.inf)  # [T, H, L]
        r.v32 = r.kv64[:, : s.sc.kv_lora_rank].float() * s.sc.v_scale  # [L, Dv]
        ratio = s.row_ratio(s.o64[r.rows], s.ref[r.rows], r.rows).flatten()  # [T * H]
        r.fit_rows = torch.argsort(torch.nan_to_num(ratio, posinf=1e300), descending=True)[:FIT_HEADS]
    S = r.raw32.flatten(0, 1)[r.fit_rows] if fit else r.raw32  # [k, L] or [T, H, L]
    S = S * scale
    if cap > 0:
        S = cap * torch.tanh(S / cap)
    return (torch.softmax(S, dim=-1) @ r.v32).double()


def fit_1d(s: Search, f: Callable[[float], torch.Tensor], lo: float, hi: float, n: int = 31) -> float:
    """argmin over x in [lo, hi] (log grid, then golden section) of the squared error on the worst
    request's worst rows; ``f(x)`` returns those rows [k, Dv] (worst_out(..., fit=True))."""
    r = s.req(s.worst_request)
    o = s.o64[r.rows].flatten(0, 1)[r.fit_rows]  # [k, Dv]
    w = 1.0 / s.row_tol[r.rows].flatten()[r.fit_rows][:, None]  # weight rows by their allowance

    def loss(logx: float) -> float:
        d = torch.nan_to_num((f(math.exp(logx)) - o) * w, nan=1e6, posinf=1e6, neginf=-1e6)
        return float((d * d).sum())

    grid = torch.linspace(math.log(lo), math.log(hi), n).tolist()
    vals = [loss(x) for x in grid]
    k = min(range(n), key=vals.__getitem__)
    a, c = grid[max(k - 1, 0)], grid[min(k + 1, n - 1)]
    g = (math.sqrt(5) - 1) / 2
    x1, x2 = c - g * (c - a), a + g * (c - a)
    f1, f2 = loss(x1), loss(x2)
    for _ in range(26):  # bracket * 0.618**26 ~ 4e-6 of two grid steps
        if f1 < f2:
            c, x2, f2 = x2, x1, f1
            x1 = c - g * (c - a)
            f1 = loss(x1)
        else:
            a, x1, f1 = x1, x2, f2
            x2 = a + g * (c - a)
            f2 = loss(x2)
    return math.exp((a + c) / 2)


def scale_candidates(s: Search) -> list[tuple[float, str]]:
    """Ratios r (kernel used r * sm_scale) that name a known mistake."""
    sm = s.sc.sm_scale
    D = s.cap.meta.head_dim
    out: list[tuple[float, str]] = []
    # DeepSeek-V3 / Kimi-K2: sm_scale = qk_head_dim**-0.5 * mscale**2 (qk_head_dim 192 = 128 nope + 64 rope)
    for qk in (192, D, s.sc.kv_lora_rank, 128):
        m2 = sm * math.sqrt(qk)
        if m2 > 1.0 + 1e-6:  # a yarn mscale^2 is in there
            out += [(1 / m2, f"without yarn mscale^2 (1/sqrt({qk}) only)"),
                    (1 / math.sqrt(m2), f"yarn mscale once instead of squared (qk_head_dim {qk})"),
                    (m2, f"yarn mscale^2 applied twice (qk_head_dim {qk})")]  # fmt: skip
        out.append((qk**-0.5 / sm, f"1/sqrt({qk}) instead of the given sm_scale"))
    out += [(LOG2E, "scaled by log2(e) twice (exp2 path)"), (1 / LOG2E, "log2(e) missing in an exp2 softmax"),
            (1 / sm, "no softmax scale at all")]  # fmt: skip
    return [(r, why) for r, why in out if abs(r - 1) > 1e-6]


def rounded(x: float) -> list[tuple[float, str]]:
    """A fitted value and its rounder neighbours (2 and 3 significant digits): people set round
    numbers, and a candidate that screens equally well sorts by its score anyway."""
    out = [(float(f"{x:.2g}"), "fitted, rounded"), (float(f"{x:.3g}"), "fitted, rounded"), (x, "fitted")]
    return list({v: (v, why) for v, why in reversed(out)}.values())[::-1]


def prefer(cands: list[tuple]) -> list[tuple]:
    """(score, value, why) in preference order -> the order to confirm them: those screening within
    tolerance keep their preference order (named before fitted, round before exact), then the rest
    by score."""
    ok = [c for c in cands if c[0] <= 1.0]
    return ok + sorted((c for c in cands if c[0] > 1.0), key=lambda c: c[0])


def search_scale(s: Search) -> Optional[dict]:
    sm, cap = s.sc.sm_scale, s.sc.logit_cap
    if not s.req(s.worst_request).L:
        return None

    def score(ratio: float) -> float:
        return rescore(s, s.worst_request, worst_out(s, ratio * sm, cap))

    ranked = [(score(x), x, why) for x, why in scale_candidates(s)]
    if min((c[0] for c in ranked), default=math.inf) > GOOD:  # no named mistake fits: fit the ratio
        fitted = fit_1d(s, lambda x: worst_out(s, x * sm, cap, fit=True), 0.05, 20.0)
        if all(abs(fitted / x - 1) > 2e-3 for _, x, _ in ranked):
            ranked += [(score(x), x, why) for x, why in rounded(fitted)]
    ranked = prefer(ranked)

    def candidates():
        for sc_, x, why in ranked:
            if sc_ >= SCREEN:
                return
            exp, ctl = full_under(s, dataclasses.replace(s.sc, sm_scale=x * sm))
            yield Candidate({"ratio": x}, exp, ctl, extra={"why": why, "sm_scale_used": x * sm})

    return global_hypothesis(s, "wrong_sm_scale", candidates())


def describe_mapping(m: list[int]) -> str:
    H = len(m)
    ident = list(range(H))
    if H < 16 and 16 % H == 0:
        f = 16 // H
        if m == [h // f for h in range(H)]:
            return f"head padding: repeat_interleave({f}) to 16 heads, output sliced [:{H}] instead of [::{f}]"
        if m == [(h * f) % H for h in range(H)]:
            return f"head padding: tiled (repeat) to 16 heads, output sliced [::{f}] instead of [:{H}]"
    for k in range(1, H):
        if m == ident[-k:] + ident[:-k]:
            return f"heads rotated by {k}: output head h holds reference head (h - {k}) mod {H}"
    if sorted(m) == ident:
        return "heads permuted: output head h holds reference head heads[h]"
    return "heads duplicated: output head h holds reference head heads[h]"


def search_heads(s: Search) -> Optional[dict]:
    o, e = s.o64, s.ref
    R, H, _ = o.shape
    rows = torch.arange(R) if s.mask is None else torch.nonzero(s.mask).flatten()
    if H < 2 or len(rows) == 0:
        return None
    cost = torch.empty(H, H, dtype=torch.float64)  # [output head, reference head]
    for h in range(H):
        d = (o[rows, h][:, None, :] - e[rows]).abs().amax(-1)  # [r, H]
        cost[h] = torch.nan_to_num(d / s.row_tol[rows], nan=math.inf).amax(0)
    m = cost.argmin(1).tolist()
    if m == list(range(H)):
        return None
    idx = torch.tensor(m)
    cand = Candidate({"mapping": describe_mapping(m), "heads": m}, e[:, idx], s.ctrl[:, idx])
    return global_hypothesis(s, "head_misaligned", iter([cand]))


CAPS = (30.0, 50.0, 20.0, 15.0, 10.0, 25.0, 40.0, 60.0)  # soft caps models use (Grok 30, Gemma-2 50)


def search_cap(s: Search) -> Optional[dict]:
    sm, given = s.sc.sm_scale, s.sc.logit_cap
    if not s.req(s.worst_request).L:
        return None

    def score(c: float) -> float:
        return rescore(s, s.worst_request, worst_out(s, sm, c))

    named = [(0.0, "soft cap omitted")] if given > 0 else []
    named += [(c, "a common soft cap") for c in CAPS if abs(c - given) > 1e-9]
    ranked = [(score(c), c, why) for c, why in named]
    if min((c[0] for c in ranked), default=math.inf) > GOOD:
        fitted = fit_1d(s, lambda c: worst_out(s, sm, c, fit=True), 1.0, 1000.0)
        for c, why in rounded(fitted):
            if all(abs(c - x) > 1e-9 for _, x, _ in ranked):
                ranked.append((score(c), c, why))
    ranked = prefer(ranked)

    def candidates():
        for sc_, c, why in ranked:
            if sc_ >= SCREEN:
                return
            exp, ctl = full_under(s, dataclasses.replace(s.sc, logit_cap=c))
            yield Candidate({"logit_cap": c}, exp, ctl, extra={"why": why, "given_logit_cap": given})

    return global_hypothesis(s, "logit_cap_mismatch", candidates())


SEARCHES: dict[str, Callable[[Search], Optional[dict]]] = {
    "seq_len_off_by": search_seq_len,
    "kv_range_missing": search_range,
    "split_missing": search_split,
    "wrong_sm_scale": search_scale,
    "head_misaligned": search_heads,
    "logit_cap_mismatch": search_cap,
}

__all__ = ["HYPOTHESES", "SEARCHES", "Search", "explain_failure"]
