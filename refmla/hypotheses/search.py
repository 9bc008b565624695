"""What every hypothesis search of one failing output shares: which (row, head) pairs and requests
fail, each request's pieces in fp64, attention under a modified sequence, and the comparator as
the judge of a candidate."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, TypeVar

import torch

from refmla import reference as ref
from refmla.compare import Comparison, compare, judged_dtype
from refmla.context import ReplayContext
from refmla.control import Rounding, attend_control
from refmla.results import Explanation
from refmla.scales import Scales

SCREEN = 4.0  # a candidate is confirmed only if its screening ratio (err / allowed) is below this
CONFIRM_TOP = 3  # candidates confirmed per request / per global hypothesis before giving up

V = TypeVar("V")


@dataclass
class Req:
    """One request's pieces in fp64, built once."""

    b: int
    rows: torch.Tensor  # [T] rows of `out` (decode: [b]; extend: its tokens)
    pool_rows: torch.Tensor  # [L] pool rows in position order
    q64: torch.Tensor  # [T, H, D]
    kv64: torch.Tensor  # [L, D]
    raw: torch.Tensor  # [T, H, L] q . k * k_scale (no sm_scale, no cap)
    vis: torch.Tensor  # [T] one past the last position each token attends (decode: L; Attended.extent)
    kvs: Optional[torch.Tensor] = None  # [L, D] in the stored dtype, gathered on first use
    tree: Optional[torch.Tensor] = None  # [T, L] verify: the tree mask's visibility (None: a prefix)

    def visible(self) -> torch.Tensor:
        """[T, L] bool: the positions each token attends (causal bottom-right, and the tree mask)."""
        vis = torch.arange(self.L)[None, :] < self.vis[:, None]  # [T, L]
        return vis if self.tree is None else vis & self.tree

    @property
    def T(self) -> int:
        return len(self.rows)

    @property
    def L(self) -> int:
        return len(self.pool_rows)


@dataclass
class Candidate:
    """One setting of a hypothesis and what the output should be under it."""

    detail: dict[str, Any]  # the hypothesis' parameters, e.g. {"delta": -1}: the explanation's detail
    expected: torch.Tensor  # fp64, the request's rows [T, H, Dv] or the whole output [R, H, Dv]
    control: torch.Tensor  # same shape, in the compare dtype
    score: float = math.inf  # screening ratio (err / allowed): lower is more promising
    extra: dict[str, Any] = field(default_factory=dict)  # keys the explanation carries besides detail
    simplicity: tuple = ()  # lower is simpler: among candidates that confirm, the simplest is reported


class Search:
    """What every hypothesis search of one failing output shares."""

    def __init__(self, ctx: ReplayContext, out: torch.Tensor, cmp: Comparison):
        cap = ctx.cap
        self.ctx, self.cap, self.cmp = ctx, cap, cmp
        self.sc, self.att = cap.scales(), cap.attended()
        self.dtype = judged_dtype(out.dtype)
        self.out = out.detach().cpu()
        self.o64 = self.out.double()  # [R, H, Dv]
        self.ref = ctx.ref_out  # [R, H, Dv] fp64
        self.ctrl = ctx.control(self.dtype)  # [R, H, Dv]
        p = ctx.producer  # candidates' controls round as the producer declares (q whole_e4m3: as the pool)
        q_round = "latent_to_pool" if p.q_round == "whole_e4m3" else p.q_round
        self.rounding = Rounding(q_round=q_round, dequant=p.dequant, p_block=p.p_block)
        self.tol = ctx.opts.tol
        self.req_of_row = cap.request_of_row()  # [R]
        R, H = self.o64.shape[0], self.o64.shape[1]
        self.mask = None if cmp.compared_rows >= R * H else ~ctx.empty_rows()  # as the replay compared
        self.row_tol = cmp.row_tol.clamp(min=1e-300)  # [R, H]
        self.too_large: dict[int, str] = {}  # failing requests past the search's budget: why
        self.bad_rows, self.failing = self._failing()  # [R, H]; failing requests, worst first
        self.worst_request = self.failing[0] if self.failing else None
        self._reqs: dict[int, Req] = {}
        self._memo: dict[str, Any] = {}

    def _failing(self) -> tuple[torch.Tensor, list[int]]:
        """The (row, head) pairs the comparator failed [R, H] (its own per-row verdicts), and the
        failing requests, worst first."""
        ratio = self.row_ratio(self.o64, self.ref)  # [R, H]
        bad = self.cmp.row_failed if self.cmp.row_failed is not None else torch.zeros_like(ratio, dtype=torch.bool)
        worst = torch.where(bad, ratio, torch.zeros_like(ratio)).amax(-1)  # [R]
        per_req: dict[int, float] = {}
        for r in torch.nonzero(bad.any(-1)).flatten().tolist():
            b = int(self.req_of_row[r])
            per_req[b] = max(per_req.get(b, 0.0), float(worst[r]))
        for b in list(per_req):  # past the search's budget: left out, and said (explain_failure)
            if (why := self.ctx.too_large_to_search(b)) is not None:
                self.too_large[b] = why
                del per_req[b]
        return bad, sorted(per_req, key=lambda b: -per_req[b])

    # -- row measures ------------------------------------------------------------------------

    def row_ratio(self, o64: torch.Tensor, expected: torch.Tensor, rows: Optional[torch.Tensor] = None) -> torch.Tensor:
        """max |o - expected| / allowed per (row, head); NaN/Inf where they differ -> inf."""
        tol = self.row_tol if rows is None else self.row_tol[rows]
        d = (o64 - expected).abs()
        same = (torch.isnan(o64) == torch.isnan(expected)) & (torch.isinf(o64) == torch.isinf(expected))
        d = torch.where(torch.isfinite(d), d, torch.where(same, torch.zeros_like(d), torch.full_like(d, math.inf)))
        return d.amax(-1) / tol

    def magnitude_ratio(self, expected: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """[T, H] how much larger than the reference's a candidate's row is (at least 1)."""
        finite = torch.isfinite(expected)
        mag = torch.where(finite, expected.abs(), torch.zeros_like(expected)).amax(-1)  # [T, H]
        ref = self.ref[rows]
        ref_mag = torch.where(torch.isfinite(ref), ref.abs(), torch.zeros_like(ref)).amax(-1).clamp(min=1e-300)
        return (mag / ref_mag).clamp(min=1.0)

    def rows_of(self, b: int) -> torch.Tensor:
        return torch.tensor(list(self.att.queries(b)), dtype=torch.long)

    def heads_failing(self, b: int) -> list[int]:
        return torch.nonzero(self.bad_rows[self.rows_of(b)].any(0)).flatten().tolist()

    # -- per-request pieces ------------------------------------------------------------------

    def req(self, b: int) -> Req:
        if b not in self._reqs:
            cap, att = self.cap, self.att
            rows = torch.tensor(list(att.queries(b)), dtype=torch.long)  # [T]
            pool_rows = att.group_rows(b)  # [L]
            q64 = cap.q[rows].double()  # [T, H, D]
            kv64 = ref.gather(cap.kv_buffer, pool_rows, torch.float64)  # [L, D]
            raw = torch.einsum("thd,ld->thl", q64, kv64) * self.sc.k_scale  # [T, H, L]
            tree = att.visibility(b) if att.has_mask else None  # [T, L]
            self._reqs[b] = Req(b, rows, pool_rows, q64, kv64, raw, att.extent(b), tree=tree)
        return self._reqs[b]

    def memo(self, key: str, build: Callable[[], V]) -> V:
        """``build()`` once per search: pieces one family computes and later families reuse."""
        if key not in self._memo:
            self._memo[key] = build()
        return self._memo[key]

    def attend_rows(
        self,
        b: int,
        seq_rows: torch.Tensor,
        vis: torch.Tensor,
        keep: Optional[torch.Tensor] = None,
        zero: Optional[torch.Tensor] = None,
        sc: Optional[Scales] = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Reference (fp64) and control (compare dtype) of request b's rows under a modified sequence.

        seq_rows [S] pool rows in position order; token t attends positions [0, vis[t]) that are in
        ``keep`` (default all), rows in ``zero`` read as all-zero.
        """
        kv64, kvs = self._sequence(self.req(b), seq_rows, zero)
        return self.attend_kv(b, kv64, kvs, vis, keep, sc)

    def attend_kv(
        self,
        b: int,
        kv64: torch.Tensor,
        kvs: torch.Tensor,
        vis: torch.Tensor,
        keep: Optional[torch.Tensor] = None,
        sc: Optional[Scales] = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`attend_rows` over given rows: kv64 [S, D] fp64 and kvs [S, D] in the stored dtype
        (the same values), e.g. rows a kernel read from somewhere else than the request's slots."""
        sc = sc or self.sc
        r = self.req(b)
        H, Dv = r.q64.shape[1], sc.kv_lora_rank
        exp = torch.empty(r.T, H, Dv, dtype=torch.float64)
        ctl = torch.empty(r.T, H, Dv, dtype=self.dtype)
        for t in range(r.T):
            sel = torch.arange(int(vis[t]))
            if r.tree is not None:  # positions past the request's end (seq_len_off_by k > 0) stay visible
                sel = sel[torch.cat([r.tree[t], torch.ones(max(0, len(sel) - r.L), dtype=torch.bool)])[sel]]
            if keep is not None:
                sel = sel[keep[sel]]
            exp[t] = ref.attend(r.q64[t], kv64[sel], sc)[0]
            ctl[t] = attend_control(self.cap.q[r.rows[t]], kvs[sel], sc, self.dtype, self.rounding)[0]
        return exp, ctl

    def own_rows(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Request b's rows in position order, fp64 and as stored [L, D] (gathered once; not to be
        written: clone before changing them)."""
        return self._sequence(self.req(b), self.req(b).pool_rows, None)

    def _sequence(
        self, r: Req, seq_rows: torch.Tensor, zero: Optional[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows ``seq_rows`` of the pool in fp64 and in the stored dtype [S, D], ``zero`` rows zeroed."""
        if seq_rows is r.pool_rows:  # the request's own rows: gathered once
            if r.kvs is None:
                r.kvs = ref.gather(self.cap.kv_buffer, seq_rows, self.cap.kv_buffer.dtype)
            kv64, kvs = r.kv64, r.kvs
        else:
            kv64 = ref.gather(self.cap.kv_buffer, seq_rows, torch.float64)  # [S, D]
            kvs = ref.gather(self.cap.kv_buffer, seq_rows, self.cap.kv_buffer.dtype)  # stored dtype
        if zero is not None and bool(zero.any()):
            kv64, kvs = kv64.clone(), kvs.clone()
            kv64[zero] = 0
            bits(kvs)[zero] = 0  # all-zero bits are +0.0 in every float dtype (fp8 has no masked_fill)
        return kv64, kvs

    # -- confirmation ------------------------------------------------------------------------

    def confirm(self, expected: torch.Tensor, control: torch.Tensor, rows: Optional[torch.Tensor] = None) -> Comparison:
        """The comparator on the whole output, or on ``rows`` only."""
        if rows is None:
            return compare("hypothesis", self.out, expected, control, out_dtype=self.dtype, tol=self.tol,
                           row_mask=self.mask, request_of_row=self.req_of_row)  # fmt: skip
        mask = None if self.mask is None else self.mask[rows]
        return compare("hypothesis", self.out[rows], expected, control, out_dtype=self.dtype, tol=self.tol,
                       row_mask=mask, request_of_row=self.req_of_row[rows])  # fmt: skip


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed as integers of its width (the same storage): what writes and byte-level reads
    use, since fp8 tensors support neither masked_fill nor index_put."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


SearchFn = Callable[[Search], Optional[Explanation]]  # one family's search: its explanation, or None
