"""STAND-IN for ``vllm.vllm_flash_attn`` (tests only; put in sys.modules under that name). Not a kernel.

Written from vLLM 0.33.0's ``flash_attn_varlen_func(q, k, v, max_seqlen_q, cu_seqlens_q,
max_seqlen_k, cu_seqlens_k=None, seqused_k=None, q_v=None, ..., softmax_scale=None, causal=False,
..., block_table=None, return_softmax_lse=False, ..., fa_version=...)`` as FLASH_ATTN_MLA calls it:
q = q_pe [T, H, 64], k = k_pe [pages, P, 1, 64], v = c_kv [pages, P, 1, 512], q_v = q_nope
[T, H, 512], block_table int32, seqused_k int32, fa_version 3, pages a multiple of 16 rows.
Returns (out [T, H, 512], softmax_lse [H, T]).
"""

from __future__ import annotations

import torch

from paged_standin_ref import CALLS, attend, int32_lens, int32_table, need

__refmla_standin__ = True


def flash_attn_varlen_func(q, k, v, max_seqlen_q, cu_seqlens_q, max_seqlen_k, cu_seqlens_k=None, seqused_k=None,
                           q_v=None, dropout_p=0.0, softmax_scale=None, causal=False, window_size=None, softcap=0.0,
                           alibi_slopes=None, deterministic=False, return_attn_probs=False, block_table=None,
                           return_softmax_lse=False, out=None, scheduler_metadata=None, q_descale=None,
                           k_descale=None, v_descale=None, num_splits: int = 0, fa_version: int = 2):  # fmt: skip
    need(fa_version == 3, "q_v (MLA) needs fa_version=3")
    need(q_v is not None and q.dim() == 3 and q.shape[-1] == 64 and q_v.shape[-1] == 512, "q = q_pe [T, H, 64], q_v = q_nope [T, H, 512]")
    T = q.shape[0]
    need(k.dim() == 4 and k.shape[2] == 1 and k.shape[3] == 64 and v.shape[3] == 512, "k [pages, P, 1, 64], v [pages, P, 1, 512]")
    need(k.shape[1] % 16 == 0, f"page size {k.shape[1]} is not a multiple of 16")
    need(max_seqlen_q == 1 and torch.equal(cu_seqlens_q.cpu(), torch.arange(T + 1, dtype=torch.int32)), "decode: cu_seqlens_q = arange")
    int32_table("block_table", block_table, T)
    int32_lens("seqused_k", seqused_k, T)
    need(cu_seqlens_k is None, "paged decode takes seqused_k, not cu_seqlens_k")
    pool = torch.cat([v[:, :, 0], k[:, :, 0]], -1)  # [pages, P, 576]
    o, lse = attend(torch.cat([q_v, q], -1), pool, block_table, seqused_k, softmax_scale)
    CALLS.append({"kernel": "flash_attn_varlen_func", "T": T, "page": k.shape[1]})
    return (o, lse.T.contiguous()) if return_softmax_lse else o
