"""The reference: absorbed-MLA attention over a paged latent KV cache, written as the math reads.

Shapes (B requests, H query heads, D = kv_lora_rank + qk_rope_head_dim, Dv = kv_lora_rank,
N pool rows, L_b tokens attended by request b):

    q          [R, H, D]     absorbed query (q_nope @ w_kc, then rope'd q_pe), one row per query token
    kv_buffer  [N, 1, D]     latent KV pool; K is the whole row, V its first Dv dims
    att        Attended      which pool rows each query row reads (refmla.attended: decode, extend,
                             verify with or without a tree mask; built once per capture)
    sc         Scales        kv_lora_rank, sm_scale, logit_cap, k_scale, v_scale (refmla.scales)

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

from refmla.attended import Attended, Positions
from refmla.blocked import Spans, attend_spans
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


def gather(kv_buffer: torch.Tensor, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """kv_buffer [N, 1, D] -> the given rows [L, D] upcast to ``dtype`` (one copy)."""
    return kv_buffer[:, 0].index_select(0, rows.to(kv_buffer.device)).to(dtype)


# --------------------------------------------------------------------------------------------
# Decode: one query row per request, all of it
# --------------------------------------------------------------------------------------------


def mla_decode_ref(
    q: torch.Tensor, kv_buffer: torch.Tensor, att: Attended, sc: Scales, *, accum_dtype: torch.dtype = torch.float64
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode: query row b reads all of group b. Returns out [B, H, Dv] and lse [B, H] in accum_dtype.

    The work is blocked and batched (refmla.blocked): memory stays within a fixed budget whatever
    the lengths and the index pattern; the result is :func:`attend`'s to fp64 rounding."""
    return attend_spans(q, kv_buffer, Spans.of_attended(one_pool(att)), sc, accum_dtype)


# --------------------------------------------------------------------------------------------
# Split-KV decode: partials of SGLang's Triton schedule (refmla.schedule) and their merge
# --------------------------------------------------------------------------------------------


def mla_decode_split_ref(
    q: torch.Tensor,
    kv_buffer: torch.Tensor,
    att: Attended,
    num_kv_splits: torch.Tensor,
    sc: Scales,
    *,
    max_kv_splits: int | None = None,
    accum_dtype: torch.dtype = torch.float64,
    attend_fn=None,
    split_block: int = MIN_BLOCK_KV,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-split partials of the Triton schedule (decode: query row b reads group b).

    Returns attn_logits [B, H, S, Dv] (each split's normalized output, v_scale applied),
    attn_lse [B, H, S] and valid [B, S] (False for empty splits, whose partials are 0 / -inf).
    S = max_kv_splits, or the most splits that hold a token (at least 1) when not given.
    ``split_block``: the schedule's granularity (32 SGLang, 1 vLLM's uniform ceil(L / n)).
    ``attend_fn(q [H, D], kv_buffer, rows [n], sc)`` replaces :func:`attend` per split, reading the
    split's pool rows as stored (the low-precision control passes its own:
    refmla.control.mla_decode_split_control).
    """
    B, H, _ = q.shape
    lens = att.lengths()  # [B]
    most = int(nonempty_splits_batch(lens, num_kv_splits, split_block).max()) if B else 1  # splits that hold a token
    S = int(max_kv_splits) if max_kv_splits else max(most, 1)
    parts = torch.zeros(B, H, S, sc.kv_lora_rank, dtype=accum_dtype, device=q.device)
    lses = torch.full((B, H, S), -math.inf, dtype=accum_dtype, device=q.device)
    valid = torch.zeros(B, S, dtype=torch.bool)
    held = [(b, s, int(att.indptr[b]) + start, end - start) for b in range(B)
            for s, (start, end) in enumerate(split_bounds(int(lens[b]), int(num_kv_splits[b]), split_block)[:S])
            if end > start]  # fmt: skip
    b_of, s_of, starts, span_lens = (list(c) for c in zip(*held)) if held else ([], [], [], [])  # splits with a token
    if attend_fn is not None:  # the control: its own math per split, on the inputs as stored
        for b, s, start, n in zip(b_of, s_of, starts, span_lens):
            parts[b, :, s], lses[b, :, s] = attend_fn(q[b], kv_buffer, att.rows[start : start + n], sc)
    elif b_of:
        spans = Spans(att.rows, torch.tensor(starts), torch.tensor(span_lens), torch.tensor(b_of))
        o, l = attend_spans(q, kv_buffer, spans, sc, accum_dtype)  # [P, H, Dv], [P, H]
        parts[b_of, :, s_of], lses[b_of, :, s_of] = o, l
    valid[b_of, s_of] = True
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
# Any layout: extend / prefill, verify (causal bottom-right or a tree mask), decode too
# --------------------------------------------------------------------------------------------


def one_pool(att: Attended) -> Attended:
    """``att``, refused (ValueError) when it reads two pools: the variants here gather from one
    ``kv_buffer``; the two-pool constructor (DeepSeek-V4) brings the gather by ``pool_ids``."""
    if att.pool_ids is not None:
        raise ValueError("this reference variant reads one pool; the description has pool_ids (two pools)")
    return att


def seen(kv: torch.Tensor, pos: Positions) -> torch.Tensor:
    """The rows of a group's gathered kv [L, D] one query row sees (refmla.attended.Positions)."""
    return kv[pos if isinstance(pos, slice) else pos.to(kv.device)]


def mla_verify_ref(
    q: torch.Tensor, kv_buffer: torch.Tensor, att: Attended, sc: Scales, *, accum_dtype: torch.dtype = torch.float64
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every query row over what ``att`` says it sees: extend / prefill and chain verify (its last
    n_b positions, causal bottom-right), a tree verify (its mask row), decode (all of its group).
    q [R, H, D] -> out [R, H, Dv], lse [R, H] in accum_dtype; a row that sees nothing: 0 / -inf."""
    return attend_spans(q, kv_buffer, Spans.of_attended(one_pool(att)), sc, accum_dtype)  # blocked, batched


def mla_ref(
    q: torch.Tensor, kv_buffer: torch.Tensor, att: Attended, sc: Scales, *, accum_dtype: torch.dtype = torch.float64
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference of any call: :func:`mla_decode_ref` when each query row reads its whole group
    (decode), else :func:`mla_verify_ref`. out [R, H, Dv], lse [R, H]."""
    fn = mla_decode_ref if one_pool(att).one_query_per_group else mla_verify_ref
    return fn(q, kv_buffer, att, sc, accum_dtype=accum_dtype)


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
    sc: Scales,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference in aiter's convention: kv_buffer [num_pages, page_size, 1, D] (or [N, 1, D]),
    page-level indices and last-page lengths. Same result as the token-level reference."""
    pool = kv_buffer.reshape(-1, 1, kv_buffer.shape[-1])  # [num_pages * page_size, 1, D]
    kv_indptr, kv_indices = page_to_token(kv_page_indptr, kv_page_indices, kv_last_page_lens, page_size)
    return mla_decode_ref(q, pool, Attended.token_index(kv_indptr, kv_indices), sc)
