"""STAND-IN for ``sgl_kernel``'s CUTLASS MLA decode (tests only). Not a kernel.

Written from sgl_kernel's ``cutlass_mla_decode(q_nope [B, 128, 512], q_pe [B, 128, 64],
kv_c_and_k_pe_cache [pages, P, 576], seq_lens int32 [B], page_table int32 [B, M] with M a
multiple of 128 / P, workspace, sm_scale, num_kv_splits=1) -> out [B, 128, 512]`` and
``cutlass_mla_get_workspace_size(max_seq_len, num_batches, sm_count=0, num_kv_splits=1)``
(SGLang 0.5.23 cutlass_mla_backend.py). 128 heads exactly: callers pad.
"""

from __future__ import annotations

import torch

from paged_standin_ref import CALLS, attend, int32_lens, int32_table, need

__refmla_standin__ = True


def cutlass_mla_get_workspace_size(max_seq_len: int, num_batches: int, sm_count: int = 0, num_kv_splits: int = 1) -> int:
    return 1024 + 16 * num_batches


def cutlass_mla_decode(q_nope, q_pe, kv_c_and_k_pe_cache, seq_lens, page_table, workspace, sm_scale, num_kv_splits=1):
    need(q_nope.dim() == 3 and q_nope.shape[1:] == (128, 512), f"q_nope must be [B, 128, 512], got {list(q_nope.shape)}")
    B = q_nope.shape[0]
    need(q_pe.shape == (B, 128, 64), f"q_pe must be [B, 128, 64], got {list(q_pe.shape)}")
    need(q_nope.dtype == q_pe.dtype == kv_c_and_k_pe_cache.dtype, "q_nope, q_pe and the cache must share a dtype")
    P = kv_c_and_k_pe_cache.shape[1]
    need(kv_c_and_k_pe_cache.dim() == 3 and kv_c_and_k_pe_cache.shape[2] == 576, "kv_c_and_k_pe_cache must be [pages, P, 576]")
    int32_table("page_table", page_table, B)
    need(page_table.shape[1] % max(128 // P, 1) == 0, f"page_table columns must be a multiple of 128 / {P}")
    int32_lens("seq_lens", seq_lens, B)
    need(workspace.numel() >= cutlass_mla_get_workspace_size(0, B), "workspace smaller than cutlass_mla_get_workspace_size")
    need(num_kv_splits == 1, "num_kv_splits must be 1 here (SGLang #6101: split-KV disabled)")
    o, _ = attend(torch.cat([q_nope, q_pe], -1), kv_c_and_k_pe_cache, page_table, seq_lens, sm_scale)
    CALLS.append({"kernel": "cutlass_mla_decode", "B": B, "page": P})
    return o.to(q_nope.device)
