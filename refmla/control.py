"""The low-precision control (docs/contract.md, tolerance): the reference's math at a kernel's rounding points.

A backend passes a row when its error against the fp64 reference is at most k times this
control's error on that row (refmla.compare). The control reads q and the pool as stored, rounds
the latent part of q to a narrower pool's dtype (the Triton kernel's ``q.to(K dtype)``),
accumulates dots in fp32, rounds the probabilities to the value dtype before P.V, keeps the sums
in fp32 and rounds the output to the output dtype. With a split schedule, each split's partial is
fp32 and the merge is fp32, as the split kernels do.
"""

from __future__ import annotations

import math

import torch

from refmla.reference import Scales, gather, mla_decode_split_ref, request_rows, verify_visibility
from refmla.schedule import split_bounds



def attend_control(
    q: torch.Tensor, kv: torch.Tensor, sc: Scales, out_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same math at the kernel's rounding points, for one request.

    q [H, D] and kv [L, D] in their stored dtypes. A pool narrower than q (fp8, or bf16 under an
    fp32 q) rounds the latent part of q to the pool dtype (the Triton kernel's
    ``q.to(K_Buffer.dtype)``; the rope part meets K upcast instead); dots accumulate in fp32; the
    probabilities are rounded to the value dtype before P.V; the sum stays fp32; the output is
    rounded to ``out_dtype``. Returns out [H, Dv] in out_dtype and lse [H] in fp32.
    """
    H, Dv = q.shape[0], sc.kv_lora_rank
    if kv.shape[0] == 0:
        return q.new_zeros(H, Dv, dtype=out_dtype), q.new_full((H,), -math.inf, dtype=torch.float32)
    f32 = torch.float32
    q_nope, q_pe = q[:, :Dv], q[:, Dv:]  # [H, Dv], [H, Dr]
    if kv.dtype.itemsize < q.dtype.itemsize:  # narrower pool: the dot runs in the pool dtype
        q_nope = q_nope.to(kv.dtype)
    k32 = kv.to(f32)  # [L, D]
    s = q_nope.to(f32) @ k32[:, :Dv].T + q_pe.to(f32) @ k32[:, Dv:].T  # [H, L]
    s = s * (sc.sm_scale * sc.k_scale)
    if sc.logit_cap > 0:
        s = sc.logit_cap * torch.tanh(s / sc.logit_cap)
    m = s.max(dim=-1, keepdim=True).values  # [H, 1]
    p = torch.exp(s - m)  # [H, L] fp32
    l = p.sum(dim=-1, keepdim=True)  # [H, 1] fp32, from the unrounded probabilities
    acc = p.to(kv.dtype).to(f32) @ k32[:, :Dv]  # [H, Dv], P rounded to the value dtype
    return (acc / l * sc.v_scale).to(out_dtype), (m + torch.log(l))[:, 0]


def mla_control(
    q: torch.Tensor,
    kv_buffer: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    *,
    kv_lora_rank: int,
    sm_scale: float,
    out_dtype: torch.dtype,
    logit_cap: float = 0.0,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    qo_indptr: torch.Tensor | None = None,
    num_kv_splits: torch.Tensor | None = None,
    custom_mask: torch.Tensor | None = None,
    mask_indptr: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Low-precision control for decode (qo_indptr None), extend or verify: out in out_dtype, lse fp32.

    With ``num_kv_splits`` (decode), each request follows the production split schedule: fp32
    partials per split, merged in fp32, then rounded -- the split kernels' rounding points. With a
    verify ``custom_mask`` (refmla.reference.verify_visibility), each token sees its mask's positions.
    """
    sc = Scales(kv_lora_rank, sm_scale, logit_cap, k_scale, v_scale)
    T, H = q.shape[0], q.shape[1]
    if qo_indptr is None:
        qo_indptr = torch.arange(T + 1)
    out = torch.zeros(T, H, kv_lora_rank, dtype=out_dtype, device=q.device)  # [T, H, Dv]
    lse = torch.full((T, H), -math.inf, dtype=torch.float32, device=q.device)  # [T, H]
    for b in range(len(qo_indptr) - 1):
        q0, q1 = int(qo_indptr[b]), int(qo_indptr[b + 1])
        kv = gather(kv_buffer, request_rows(kv_indptr, kv_indices, b), kv_buffer.dtype)  # [L, D]
        prefix = kv.shape[0] - (q1 - q0)
        vis = None if custom_mask is None else verify_visibility(kv.shape[0], q1 - q0, b, custom_mask, mask_indptr)
        for i, t in enumerate(range(q0, q1)):
            if num_kv_splits is not None:
                out[t], lse[t] = attend_control_split(q[t], kv, sc, out_dtype, int(num_kv_splits[b]))
            elif vis is not None:
                out[t], lse[t] = attend_control(q[t], kv[vis[i].to(kv.device)], sc, out_dtype)
            else:
                out[t], lse[t] = attend_control(q[t], kv[: prefix + i + 1], sc, out_dtype)
    return out, lse


def attend_control_split(
    q: torch.Tensor, kv: torch.Tensor, sc: Scales, out_dtype: torch.dtype, num_splits: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """attend_control over SGLang's split schedule: fp32 partials [S, H, Dv], an fp32 merge."""
    bounds = [(s, e) for s, e in split_bounds(kv.shape[0], num_splits) if e > s]
    if len(bounds) <= 1:
        return attend_control(q, kv, sc, out_dtype)
    parts = [attend_control(q, kv[s:e], sc, torch.float32) for s, e in bounds]
    outs = torch.stack([o for o, _ in parts])  # [S, H, Dv] fp32
    lses = torch.stack([l for _, l in parts])  # [S, H] fp32
    lse = torch.logsumexp(lses, dim=0)  # [H]
    w = torch.exp(lses - lse)  # [S, H]
    return (w[..., None] * outs).sum(dim=0).to(out_dtype), lse


def mla_decode_split_control(q, kv_buffer, kv_indptr, kv_indices, num_kv_splits, **kw):
    """:func:`refmla.reference.mla_decode_split_ref` at the control's rounding points: fp32 partials
    [B, H, S, Dv] and lse [B, H, S], as the Triton stage-1 kernel stores them, and valid [B, S]."""

    def split32(qb: torch.Tensor, kv: torch.Tensor, sc: Scales):
        return attend_control(qb, kv, sc, torch.float32)

    return mla_decode_split_ref(q, kv_buffer, kv_indptr, kv_indices, num_kv_splits, **kw, attend_fn=split32)
