"""The reference: absorbed-MLA attention over a paged latent KV cache, written as the math reads.

Shapes (B requests, H query heads, D = kv_lora_rank + qk_rope_head_dim, Dv = kv_lora_rank,
N pool rows, L_b tokens attended by request b):

    q          [B, H, D]     absorbed query (q_nope @ w_kc, then rope'd q_pe)
    kv_buffer  [N, 1, D]     latent KV pool; K is the whole row, V its first Dv dims
    kv_indptr  [B + 1]       request b attends kv_indices[kv_indptr[b] : kv_indptr[b + 1]]
    kv_indices [nnz]         token-slot rows of kv_buffer, in position order (SGLang convention)

    s   = (q . k) * sm_scale * k_scale            [H, L]   scaled logits
    s   = cap * tanh(s / cap)        if cap > 0
    lse = log(sum_j exp(s_j))                     [H]      natural log
    out = sum_j exp(s_j - lse) * v_j * v_scale    [H, Dv]

Everything is computed in ``accum_dtype`` (fp64 by default). Only attended rows are ever
read, so NaN or garbage anywhere else in the pool cannot leak into an output. A request with
no tokens gets ``out = 0`` and ``lse = -inf``.

The same functions play the low-precision control of the tolerance model
(:func:`mla_decode_control`): the kernel's rounding points, fp32 accumulation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

MIN_BLOCK_KV = 32  # SGLang's Triton split granularity (_MIN_BLOCK_KV)


@dataclass(frozen=True)
class Scales:
    """Everything besides the tensors that changes the math."""

    kv_lora_rank: int  # Dv: value width, 512 for DeepSeek-V3 / Kimi-K2
    sm_scale: float  # softmax scale exactly as passed to the kernel (yarn mscale included)
    logit_cap: float = 0.0  # tanh soft cap, 0 = off
    k_scale: float = 1.0  # fp8 KV dequant scale for K
    v_scale: float = 1.0  # fp8 KV dequant scale for V


# --------------------------------------------------------------------------------------------
# One request, the core of every variant
# --------------------------------------------------------------------------------------------


def attend(q: torch.Tensor, kv: torch.Tensor, sc: Scales) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of H query heads over L latent rows, in the dtype of the inputs.

    q [H, D], kv [L, D] (already in the compute dtype) -> out [H, Dv], lse [H].
    """
    H, Dv = q.shape[0], sc.kv_lora_rank
    if kv.shape[0] == 0:
        return q.new_zeros(H, Dv), q.new_full((H,), -math.inf)
    s = (q @ kv.T) * (sc.sm_scale * sc.k_scale)  # [H, L]
    if sc.logit_cap > 0:
        s = sc.logit_cap * torch.tanh(s / sc.logit_cap)  # [H, L]
    lse = torch.logsumexp(s, dim=-1)  # [H]
    p = torch.exp(s - lse[:, None])  # [H, L], rows sum to 1
    out = (p @ kv[:, :Dv]) * sc.v_scale  # [H, Dv]
    return out, lse


def request_rows(kv_indptr: torch.Tensor, kv_indices: torch.Tensor, b: int) -> torch.Tensor:
    """Pool rows request b attends, in position order: kv_indices[kv_indptr[b]:kv_indptr[b+1]]."""
    start, end = int(kv_indptr[b]), int(kv_indptr[b + 1])
    return kv_indices[start:end].long()  # [L_b]


def gather(kv_buffer: torch.Tensor, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """kv_buffer [N, 1, D] -> the given rows [L, D] upcast to ``dtype`` (one copy)."""
    return kv_buffer[:, 0].index_select(0, rows.to(kv_buffer.device)).to(dtype)


# --------------------------------------------------------------------------------------------
# Decode
# --------------------------------------------------------------------------------------------


def mla_decode_ref(
    q: torch.Tensor,
    kv_buffer: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    *,
    kv_lora_rank: int,
    sm_scale: float,
    logit_cap: float = 0.0,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    accum_dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode: one query token per request. Returns out [B, H, Dv] and lse [B, H] in accum_dtype."""
    sc = Scales(kv_lora_rank, sm_scale, logit_cap, k_scale, v_scale)
    B, H, _ = q.shape
    out = torch.empty(B, H, kv_lora_rank, dtype=accum_dtype, device=q.device)  # [B, H, Dv]
    lse = torch.empty(B, H, dtype=accum_dtype, device=q.device)  # [B, H]
    rows_of = RowGatherer(kv_buffer, kv_indptr, accum_dtype)  # one reused buffer, not B allocations
    for b in range(B):
        kv = rows_of(request_rows(kv_indptr, kv_indices, b))  # [L, D]
        out[b], lse[b] = attend(q[b].to(accum_dtype), kv, sc)
    return out, lse


class RowGatherer:
    """gather() into buffers sized for the longest request, reused for every request.

    The same result as ``gather(kv_buffer, rows, dtype)``; it only keeps the peak memory at one
    request's working set (no allocator churn over B requests of different lengths).
    """

    def __init__(self, kv_buffer: torch.Tensor, kv_indptr: torch.Tensor, dtype: torch.dtype):
        L_max = int((kv_indptr[1:] - kv_indptr[:-1]).max()) if len(kv_indptr) > 1 else 0
        D = kv_buffer.shape[-1]
        self.pool = kv_buffer[:, 0]  # [N, D]
        self.stored = torch.empty(L_max, D, dtype=kv_buffer.dtype, device=kv_buffer.device)  # [L_max, D]
        self.upcast = torch.empty(L_max, D, dtype=dtype, device=kv_buffer.device)  # [L_max, D]

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        L = rows.shape[0]
        torch.index_select(self.pool, 0, rows.to(self.pool.device), out=self.stored[:L])
        return self.upcast[:L].copy_(self.stored[:L])  # [L, D]


# --------------------------------------------------------------------------------------------
# Split-KV decode: SGLang's Triton schedule, partials and their merge
# --------------------------------------------------------------------------------------------


def split_len(seq_len: int, num_splits: int, min_block: int = MIN_BLOCK_KV) -> int:
    """Tokens per split: ceil(ceil(L / n) / 32) * 32, as the Triton stage-1 kernel computes it."""
    n = max(int(num_splits), 1)
    return -(-(-(-seq_len // n)) // min_block) * min_block


def split_bounds(seq_len: int, num_splits: int, min_block: int = MIN_BLOCK_KV) -> list[tuple[int, int]]:
    """[start, end) of each split s < num_splits; trailing splits may be empty (start >= end)."""
    per = split_len(seq_len, num_splits, min_block)
    return [(s * per, min((s + 1) * per, seq_len)) for s in range(max(int(num_splits), 1))]


def nonempty_splits(seq_len: int, num_splits: int, min_block: int = MIN_BLOCK_KV) -> int:
    """How many of the splits hold a token: ceil(L / per). The rest are empty and never written."""
    return -(-seq_len // split_len(seq_len, num_splits, min_block)) if seq_len > 0 else 0


def mla_decode_split_ref(
    q: torch.Tensor,
    kv_buffer: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    num_kv_splits: torch.Tensor,
    *,
    kv_lora_rank: int,
    sm_scale: float,
    logit_cap: float = 0.0,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    max_kv_splits: int | None = None,
    accum_dtype: torch.dtype = torch.float64,
    control: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-split partials of the Triton schedule.

    Returns attn_logits [B, H, S, Dv] (each split's normalized output, v_scale applied),
    attn_lse [B, H, S] and valid [B, S] (False for empty splits, whose partials are 0 / -inf).
    S = max_kv_splits, or max(num_kv_splits) when not given. With ``control``, each split is
    the low-precision control instead (fp32 partials, as the Triton stage-1 kernel stores them).
    """
    sc = Scales(kv_lora_rank, sm_scale, logit_cap, k_scale, v_scale)
    B, H, _ = q.shape
    S = int(max_kv_splits) if max_kv_splits else int(num_kv_splits.max()) if B else 1
    parts = torch.zeros(B, H, S, kv_lora_rank, dtype=accum_dtype, device=q.device)
    lses = torch.full((B, H, S), -math.inf, dtype=accum_dtype, device=q.device)
    valid = torch.zeros(B, S, dtype=torch.bool)
    for b in range(B):
        rows = request_rows(kv_indptr, kv_indices, b)
        kv = gather(kv_buffer, rows, kv_buffer.dtype if control else accum_dtype)  # [L, D]
        qb = q[b] if control else q[b].to(accum_dtype)  # [H, D]
        for s, (start, end) in enumerate(split_bounds(len(rows), int(num_kv_splits[b]))[:S]):
            if end > start:
                if control:
                    parts[b, :, s], lses[b, :, s] = attend_control(qb, kv[start:end], sc, torch.float32)
                else:
                    parts[b, :, s], lses[b, :, s] = attend(qb, kv[start:end], sc)
                valid[b, s] = True
    return parts, lses, valid


def merge_splits(
    attn_logits: torch.Tensor, attn_lse: torch.Tensor, valid: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-sum-exp merge of split partials: [B, H, S, Dv], [B, H, S], [B, S] -> [B, H, Dv], [B, H]."""
    lse_s = attn_lse.masked_fill(~valid[:, None, :].to(attn_lse.device), -math.inf)  # [B, H, S]
    lse = torch.logsumexp(lse_s, dim=-1)  # [B, H]
    w = torch.exp(lse_s - lse[..., None]).nan_to_num(0.0)  # [B, H, S], empty request -> 0
    parts = attn_logits.masked_fill(~valid[:, None, :, None].to(attn_logits.device), 0.0)
    out = (w[..., None] * parts).sum(dim=2)  # [B, H, Dv]
    return out, lse


# --------------------------------------------------------------------------------------------
# Extend: several new tokens per request, causal, bottom-right aligned
# --------------------------------------------------------------------------------------------


def mla_extend_ref(
    q: torch.Tensor,
    kv_buffer: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    qo_indptr: torch.Tensor,
    *,
    kv_lora_rank: int,
    sm_scale: float,
    logit_cap: float = 0.0,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    accum_dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Extend / prefill / verify: q [T, H, D], request b's new tokens are q[qo_indptr[b]:qo_indptr[b+1]].

    The indices cover the whole sequence after the cache write; the n new tokens are the last n
    positions, so new token i (0-based) sees positions [0, L - n + i]. Returns out [T, H, Dv], lse [T, H].
    """
    sc = Scales(kv_lora_rank, sm_scale, logit_cap, k_scale, v_scale)
    T, H, _ = q.shape
    out = torch.zeros(T, H, kv_lora_rank, dtype=accum_dtype, device=q.device)  # [T, H, Dv]
    lse = torch.full((T, H), -math.inf, dtype=accum_dtype, device=q.device)  # [T, H]
    for b in range(len(qo_indptr) - 1):
        q0, q1 = int(qo_indptr[b]), int(qo_indptr[b + 1])
        kv = gather(kv_buffer, request_rows(kv_indptr, kv_indices, b), accum_dtype)  # [L, D]
        prefix = kv.shape[0] - (q1 - q0)
        for i, t in enumerate(range(q0, q1)):
            out[t], lse[t] = attend(q[t].to(accum_dtype), kv[: prefix + i + 1], sc)
    return out, lse


# --------------------------------------------------------------------------------------------
# The low-precision control (CONTRACT section 5)
# --------------------------------------------------------------------------------------------


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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Low-precision control for decode (qo_indptr None) or extend: out in out_dtype, lse fp32.

    With ``num_kv_splits`` (decode), each request follows the production split schedule: fp32
    partials per split, merged in fp32, then rounded -- the split kernels' rounding points.
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
        for i, t in enumerate(range(q0, q1)):
            if num_kv_splits is not None:
                out[t], lse[t] = attend_control_split(q[t], kv, sc, out_dtype, int(num_kv_splits[b]))
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
