"""Multi-head attention of a chunked-prefill capture's pieces, in fp64 (the reference) and at a
kernel's rounding points (the control), one request at a time:

    s    = scale * q . k                      [R, H, L]  (fp64; the control: fp32 from the stored dtypes)
    mask = causal: key l visible to row j when l <= j + (L - R) (bottom-right; top-left: l <= j)
    lse  = logsumexp over the visible keys    [R, H]     (no visible key: lse -inf, out 0)
    out  = softmax(s) . v                     [R, H, Dv] (the control rounds P to v's dtype before
                                                          P.V, keeps the sum in fp32, stores out in
                                                          the piece's dtype)

Pieces: the new tokens' (causal over the request's new keys), chunk i's (not causal, over the
request's keys of chunk i) and the whole row (causal over every prefix key of the request and its
new keys at once: what the merged output should be). Rows are taken in blocks so that the scores
of one block stay under :data:`SCORE_BYTES`.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from refmla.merge.chunked_format import ChunkedCapture
from refmla.merge.reference import Pieces, merge
from refmla.stores import store_as

SCORE_BYTES = 256 << 20  # fp64 scores of one block of rows
CAUSAL = (None, "bottom_right", "top_left")


def visible(R: int, L: int, causal: Optional[str]) -> Optional[torch.Tensor]:
    """[R, L] bool: which keys each row sees (None: all)."""
    if causal is None:
        return None
    shift = L - R if causal == "bottom_right" else 0
    return torch.arange(L)[None, :] <= torch.arange(R)[:, None] + shift


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: Optional[str] = None,
           out_dtype: Optional[torch.dtype] = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """q [R, H, Dq] over k [L, H, Dq], v [L, H, Dv]: (out [R, H, Dv], natural lse [R, H]); fp64
    when ``out_dtype`` is None, else the control, out stored in ``out_dtype`` and lse fp32."""
    R, H, Dv = q.shape[0], q.shape[1], v.shape[-1]
    wide = torch.float64 if out_dtype is None else torch.float32
    out = torch.zeros(R, H, Dv, dtype=wide)
    lse = torch.full((R, H), -math.inf, dtype=wide)
    L = k.shape[0]
    if R == 0 or L == 0:
        return (out if out_dtype is None else out.to(out_dtype)), lse
    mask = visible(R, L, causal)
    kw, vw = k.to(wide), v.to(wide)
    step = max(1, SCORE_BYTES // max(1, H * L * 8))
    for r0 in range(0, R, step):
        r1 = min(R, r0 + step)
        s = torch.einsum("rhd,lhd->rhl", q[r0:r1].to(wide), kw) * scale  # [r, H, L]
        if mask is not None:
            s = s.masked_fill(~mask[r0:r1, None, :], -math.inf)
        m = s.amax(-1, keepdim=True)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        p = torch.exp(s - m)  # [r, H, L]
        l = p.sum(-1)  # [r, H]
        pv = p if out_dtype is None else p.to(v.dtype).to(wide)  # the control: P rounded to v's dtype
        o = torch.einsum("rhl,lhd->rhd", pv, vw) / l.clamp(min=torch.finfo(wide).tiny)[..., None]
        seen = l > 0
        out[r0:r1] = torch.where(seen[..., None], o, torch.zeros_like(o))
        lse[r0:r1] = torch.where(seen, m[..., 0] + torch.log(l.clamp(min=torch.finfo(wide).tiny)), lse[r0:r1])
    return (out if out_dtype is None else store_as(out, out_dtype)), lse


def _per_request(cap: ChunkedCapture, keys, causal: Optional[str], out_dtype: Optional[torch.dtype],
                 requests=None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Every request's rows attended over ``keys(b)`` -> (k, v) [T, H, Dv] / [T, H] (lse natural)."""
    T, H, Dv = cap.q.shape[0], cap.q.shape[1], cap.new_v.shape[-1]
    out = torch.zeros(T, H, Dv, dtype=out_dtype or torch.float64)
    lse = torch.full((T, H), -math.inf, dtype=torch.float64 if out_dtype is None else torch.float32)
    scale = cap.meta.sm_scale
    for b in range(cap.requests) if requests is None else requests:
        r0, r1 = cap.qo[b], cap.qo[b + 1]
        k, v = keys(b)
        out[r0:r1], lse[r0:r1] = attend(cap.q[r0:r1], k, v, scale, causal, out_dtype)
    return out, lse


def piece(cap: ChunkedCapture, which: int, out_dtype: Optional[torch.dtype] = None, causal: Optional[str] = "",
          keys=None, requests=None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Piece ``which`` (-1: the new tokens', i: chunk i) over its documented keys, fp64 or the
    control (``out_dtype``); ``causal`` / ``keys(b)`` override its mask / keys (the hypotheses)."""
    if keys is None:
        keys = (lambda b: (cap.new_k[cap.qo[b]:cap.qo[b + 1]], cap.new_v[cap.qo[b]:cap.qo[b + 1]])) if which < 0 else \
            (lambda b: (cap.chunk_k[cap.keys(which, b)], cap.chunk_v[cap.keys(which, b)]))  # fmt: skip
    if causal == "":
        causal = "bottom_right" if which < 0 else None
    return _per_request(cap, keys, causal, out_dtype, requests)


def whole_keys(cap: ChunkedCapture, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Request b's every key: its prefix chunks in position order, then its new tokens."""
    order = sorted(range(cap.chunks), key=lambda i: int(cap.chunk_starts[i, b]))
    ks = [cap.chunk_k[cap.keys(i, b)] for i in order] + [cap.new_k[cap.qo[b]:cap.qo[b + 1]]]
    vs = [cap.chunk_v[cap.keys(i, b)] for i in order] + [cap.new_v[cap.qo[b]:cap.qo[b + 1]]]
    return torch.cat(ks), torch.cat(vs)


def whole_row(cap: ChunkedCapture) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp64 reference of the merged output: each row over its request's whole prefix and its
    causal new keys at once, (out [T, H, Dv], lse [T, H]) with lse in the capture's base."""
    out, lse = _per_request(cap, lambda b: whole_keys(cap, b), "bottom_right", None)
    return out, in_base(lse, cap.meta.lse_base)


def in_base(lse: torch.Tensor, base: str) -> torch.Tensor:
    """A natural lse in ``base`` ("e" | "2")."""
    return lse / math.log(2.0) if base == "2" else lse




def chained_control(cap: ChunkedCapture) -> tuple[torch.Tensor, torch.Tensor]:
    """The control of the merged output: every piece's control (fp32, stored in its dtype) merged
    step by step in fp32 (refmla.merge.reference.merge), each step stored in its dtype, as
    production chains them; (out, lse in the capture's base)."""
    base = cap.meta.lse_base
    acc, acc_lse = piece(cap, -1, cap.new_out.dtype)
    acc_lse = in_base(acc_lse, base)
    for i in range(cap.chunks):
        o, l = piece(cap, i, cap.chunk_out.dtype)
        out, lse = merge(Pieces(o, in_base(l, base), acc, acc_lse, base), torch.float32)
        acc, acc_lse = out.to(cap.step(i)[0].dtype), lse
    return acc, acc_lse


__all__ = ["CAUSAL", "attend", "chained_control", "in_base", "piece", "visible", "whole_keys", "whole_row"]
