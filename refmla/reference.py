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

The low-precision control of the tolerance model (the same math at the kernel's rounding points)
is in :mod:`refmla.control`.
"""

from __future__ import annotations

import math
import torch

from refmla.paged import page_to_token
from refmla.scales import Scales
from refmla.schedule import MIN_BLOCK_KV, nonempty_splits_batch, split_bounds


# --------------------------------------------------------------------------------------------
# One request, the core of every variant
# --------------------------------------------------------------------------------------------


def attend(q: torch.Tensor, kv: torch.Tensor, sc: Scales) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of H query heads over L latent rows, in the dtype of the inputs.

    q [H, D], kv [L, D] (already in the compute dtype) -> out [H, Dv], lse [H]. The [H, L] logits
    are scaled, capped and exponentiated in place: the same operations, without an [H, L] copy each.
    """
    H, Dv = q.shape[0], sc.kv_lora_rank
    if kv.shape[0] == 0:
        return q.new_zeros(H, Dv), q.new_full((H,), -math.inf)
    s = (kv @ q.T).T.mul_(sc.sm_scale * sc.k_scale)  # [H, L] (a view of [L, H]: the faster GEMM shape)
    if sc.logit_cap > 0:
        s = s.div_(sc.logit_cap).tanh_().mul_(sc.logit_cap)  # [H, L] = cap * tanh(s / cap)
    lse = torch.logsumexp(s, dim=-1)  # [H]
    p = s.sub_(lse[:, None]).exp_()  # [H, L], rows sum to 1
    out = (p @ kv[:, :Dv]).mul_(sc.v_scale)  # [H, Dv]
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
# Split-KV decode: partials of SGLang's Triton schedule (refmla.schedule) and their merge
# --------------------------------------------------------------------------------------------


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
    attend_fn=None,
    split_block: int = MIN_BLOCK_KV,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-split partials of the Triton schedule.

    Returns attn_logits [B, H, S, Dv] (each split's normalized output, v_scale applied),
    attn_lse [B, H, S] and valid [B, S] (False for empty splits, whose partials are 0 / -inf).
    S = max_kv_splits, or the most splits that hold a token (at least 1) when not given.
    ``split_block``: the schedule's granularity (32 SGLang, 1 vLLM's uniform ceil(L / n)).
    ``attend_fn(q [H, D], kv [L, D], sc)``
    replaces :func:`attend` per split, on the inputs in their stored dtypes (the low-precision
    control passes its own: refmla.control.mla_decode_split_control).
    """
    sc = Scales(kv_lora_rank, sm_scale, logit_cap, k_scale, v_scale)
    B, H, _ = q.shape
    lens = (kv_indptr[1:] - kv_indptr[:-1]).long()  # [B]
    most = int(nonempty_splits_batch(lens, num_kv_splits, split_block).max()) if B else 1  # splits that hold a token
    S = int(max_kv_splits) if max_kv_splits else max(most, 1)
    parts = torch.zeros(B, H, S, kv_lora_rank, dtype=accum_dtype, device=q.device)
    lses = torch.full((B, H, S), -math.inf, dtype=accum_dtype, device=q.device)
    valid = torch.zeros(B, S, dtype=torch.bool)
    stored = attend_fn is not None  # the control reads the inputs as stored
    for b in range(B):
        rows = request_rows(kv_indptr, kv_indices, b)
        kv = gather(kv_buffer, rows, kv_buffer.dtype if stored else accum_dtype)  # [L, D]
        qb = q[b] if stored else q[b].to(accum_dtype)  # [H, D]
        for s, (start, end) in enumerate(split_bounds(len(rows), int(num_kv_splits[b]), split_block)[:S]):
            if end > start:
                parts[b, :, s], lses[b, :, s] = (attend_fn or attend)(qb, kv[start:end], sc)
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
# Verify (speculative): several query tokens per request, causal bottom-right or a tree mask
# --------------------------------------------------------------------------------------------


def verify_visibility(
    L: int, n: int, b: int = 0, custom_mask: torch.Tensor | None = None, mask_indptr: torch.Tensor | None = None
) -> torch.Tensor:
    """[n, L] bool: which positions each of request b's n query tokens sees.

    Without a mask, causal bottom-right: query i sees positions [0, L - n + i]. With SGLang's
    ``custom_mask`` (request b's row-major [n, L] mask at ``mask_indptr[b]``), exactly its True entries.
    """
    if custom_mask is None:
        return torch.arange(L)[None, :] <= (L - n + torch.arange(n))[:, None]  # [n, L]
    start = int(mask_indptr[b])
    return (custom_mask[start : start + n * L] != 0).view(n, L).cpu()  # [n, L]


def mla_verify_ref(
    q: torch.Tensor,
    kv_buffer: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    qo_indptr: torch.Tensor,
    custom_mask: torch.Tensor | None = None,
    mask_indptr: torch.Tensor | None = None,
    *,
    kv_lora_rank: int,
    sm_scale: float,
    logit_cap: float = 0.0,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    accum_dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify: q [T, H, D], request b's n_b query tokens q[qo_indptr[b]:qo_indptr[b+1]] are its last
    n_b positions (the drafts, their KV already in the pool). Query i sees what
    :func:`verify_visibility` says: causal bottom-right, or the tree mask. out [T, H, Dv], lse [T, H]."""
    sc = Scales(kv_lora_rank, sm_scale, logit_cap, k_scale, v_scale)
    if custom_mask is None:
        return mla_extend_ref(q, kv_buffer, kv_indptr, kv_indices, qo_indptr, **_kw(sc), accum_dtype=accum_dtype)
    T, H, _ = q.shape
    out = torch.zeros(T, H, kv_lora_rank, dtype=accum_dtype, device=q.device)  # [T, H, Dv]
    lse = torch.full((T, H), -math.inf, dtype=accum_dtype, device=q.device)  # [T, H]
    for b in range(len(qo_indptr) - 1):
        q0, q1 = int(qo_indptr[b]), int(qo_indptr[b + 1])
        kv = gather(kv_buffer, request_rows(kv_indptr, kv_indices, b), accum_dtype)  # [L, D]
        vis = verify_visibility(kv.shape[0], q1 - q0, b, custom_mask, mask_indptr)  # [n, L]
        for i, t in enumerate(range(q0, q1)):
            out[t], lse[t] = attend(q[t].to(accum_dtype), kv[vis[i].to(kv.device)], sc)
    return out, lse


def _kw(sc: Scales) -> dict:
    return dict(kv_lora_rank=sc.kv_lora_rank, sm_scale=sc.sm_scale, logit_cap=sc.logit_cap,
                k_scale=sc.k_scale, v_scale=sc.v_scale)  # fmt: skip


# --------------------------------------------------------------------------------------------
# aiter's page-level convention
# --------------------------------------------------------------------------------------------


def mla_decode_ref_pages(
    q: torch.Tensor,
    kv_buffer: torch.Tensor,
    kv_page_indptr: torch.Tensor,
    kv_page_indices: torch.Tensor,
    kv_last_page_lens: torch.Tensor,
    page_size: int,
    **scales,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference in aiter's convention: kv_buffer [num_pages, page_size, 1, D] (or [N, 1, D]),
    page-level indices and last-page lengths. Same result as the token-level reference."""
    pool = kv_buffer.reshape(-1, 1, kv_buffer.shape[-1])  # [num_pages * page_size, 1, D]
    kv_indptr, kv_indices = page_to_token(kv_page_indptr, kv_page_indices, kv_last_page_lens, page_size)
    return mla_decode_ref(q, pool, kv_indptr, kv_indices, **scales)
