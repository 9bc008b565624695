"""newest_kv_unwritten {"how": "stale"}: the newest position's KV row read as other bytes (the
slot's stale content: the decode step's own KV write not landed), the row fitted from the output.

Tried last of all (after numerics' late variants): a fitted row is a free parameter of D values
per request, so every simpler cause goes first. It is testable because MLA's heads share one
latent row: without the newest row each head's output is o'_h (over the other positions, weight
sum e^lse'_h), and a row of value v taking weight alpha_h of head h gives

    o_h = (1 - alpha_h) o'_h + alpha_h v        i.e.   v = o'_h + beta_h d_h,  d_h = o_h - o'_h,
                                                                                beta_h = 1 / alpha_h

one v for every head: H * Dv equations for Dv + H unknowns. Started from the least squares in
(v, beta) (v eliminated: an H x H system), then fitted with the noise where it is, in d:
alternately alpha_h = <d_h, v - o'_h> / |v - o'_h|^2 and v given the alphas (a head the row
barely moves says nothing about v, and weighs nothing in the fit). The row's logit per head follows from alpha_h
(s_h = lse'_h + log(alpha_h / (1 - alpha_h))), its rope part from those logits (min-norm
least squares over the heads). The fitted row, rounded to the pool's dtype, is confirmed by the
comparator like any candidate, and only where it moves MIN_MOVED_HEADS heads past their
allowance (one head's output is fitted by some row whatever it holds: noise on one head is no
stale row); the zero row (``misplaced.search_newest``) is the special case
tried first.
"""

from __future__ import annotations

from typing import Optional

import torch

from refmla import reference as ref
from refmla.hypotheses.drivers import per_request, rescore
from refmla.hypotheses.misplaced import NEWEST, screened
from refmla.hypotheses.search import Candidate, Search
from refmla.results import Explanation

MIN_HEADS = 4  # fewer heads leave the shared row too free (Dv + H unknowns for H * Dv equations)
MIN_MOVED_HEADS = 3  # heads the row must move past their allowance: one head's output any row fits
FIT_ROUNDS = 30  # alternations of the per-head weights and the shared value
ALPHA_EDGE = 1e-9  # weights kept inside [0, 1 - edge]; a head below it: the row's logit for weight edge


def fit_row(q: torch.Tensor, o1: torch.Tensor, lse1: torch.Tensor, o: torch.Tensor, sc) -> Optional[torch.Tensor]:
    """The row [D] that, appended as the newest position to the rows whose attention under
    queries ``q`` [H, D] is ``o1`` [H, Dv] with ``lse1`` [H] (ref.attend), gives each head's output
    ``o`` [H, Dv] (fp64); None when the fit finds no row of positive weight (see the module docstring)."""
    Dv, scale = sc.kv_lora_rank, sc.sm_scale * sc.k_scale
    d, c = o - o1, o1.mean(0)[None] - o1  # [H, Dv]
    H = q.shape[0]
    A = torch.diag((d * d).sum(-1)) - (d @ d.T) / H  # [H, H] normal equations in beta
    beta = torch.linalg.lstsq(A, (d * c).sum(-1, keepdim=True)).solution[:, 0]  # [H]
    v = (o1 + beta[:, None] * d).mean(0)  # [Dv] the start
    for _ in range(FIT_ROUNDS):  # d_h = alpha_h (v - o'_h), the noise in d: alternate alpha and v
        u = v[None] - o1  # [H, Dv]
        alpha = ((d * u).sum(-1) / (u * u).sum(-1)).clamp(0, 1 - ALPHA_EDGE)  # [H]
        if float(alpha.max()) <= 0:
            return None
        v = (alpha[:, None] * (d + alpha[:, None] * o1)).sum(0) / (alpha * alpha).sum()
    if not bool(torch.isfinite(v).all()):
        return None
    logit = lse1 + torch.log(alpha.clamp_min(ALPHA_EDGE) / (1 - alpha))  # [H] the row's logit per head
    k_lat = v / sc.v_scale
    rhs = logit / scale - q[:, :Dv] @ k_lat  # [H] what the rope part must add
    k_rope = torch.linalg.pinv(q[:, Dv:]) @ rhs  # [D - Dv] min-norm
    return torch.cat([k_lat, k_rope])


def stale_candidate(s: Search, b: int) -> Optional[Candidate]:
    r, sc = s.req(b), s.sc
    H = r.q64.shape[1]
    if r.L < 2 or r.T != 1 or H < MIN_HEADS or sc.logit_cap > 0 or sc.v_scale == 0 or sc.k_scale == 0:
        return None
    o = s.o64[r.rows[0]]  # [H, Dv]
    o1, lse1 = ref.attend(r.q64[0], r.kv64[:-1], sc)  # [H, Dv], [H] without the newest row
    moved = int(((o - o1).abs().amax(-1) > s.row_tol[r.rows[0]]).sum())  # the heads that constrain the row
    if not bool(torch.isfinite(o).all()) or moved < MIN_MOVED_HEADS:
        return None
    row = fit_row(r.q64[0], o1, lse1, o, sc)
    if row is None:
        return None
    kv64, kvs = (x.clone() for x in s.own_rows(b))
    kvs[-1] = row.to(kvs.dtype)  # the stale bytes as the pool stores them
    kv64[-1] = kvs[-1].double()
    if not bool(torch.isfinite(kv64[-1]).all()):
        return None
    exp, ctl = s.attend_kv(b, kv64, kvs, r.vis)
    weight = float(torch.softmax(r.q64[0] @ kv64.T * sc.sm_scale * sc.k_scale, -1)[:, -1].max())
    return Candidate({"how": "stale"}, exp, ctl, rescore(s, b, exp),
                     extra={"position": r.L - 1, "row_weight": round(weight, 4),
                            "why": "a row fitted to the output: the slot's stale content, not the step's KV"})  # fmt: skip


def search(s: Search) -> Optional[Explanation]:
    if not s.cap.is_decode:
        return None
    return per_request(s, NEWEST, screened(stale_candidate))


__all__ = ["MIN_HEADS", "MIN_MOVED_HEADS", "fit_row", "search", "stale_candidate"]
