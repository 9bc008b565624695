"""STAND-IN for ``flashinfer.decode`` (tests only). Not a kernel.

Written from ``trtllm_batch_decode_with_kv_cache_mla`` (FlashInfer 0.7, as vLLM 0.33.0's
FLASHINFER_MLA calls it): query [B, q_len, H, 576], kv_cache [pages, 1, P, 576] or [pages, P, 576]
with P in (32, 64), workspace_buffer (zeroed), qk_nope_head_dim, kv_lora_rank 512,
qk_rope_head_dim 64, block_tables int32 [B, M], seq_lens int32 [B], max_seq_len >= every seq_len,
bmm1_scale (the softmax scale), bmm2_scale (the output scale) -> out [B, q_len, H, 512]
(and lse when return_lse). An fp8 (e4m3) cache wants an e4m3 query; the scores are then
(query . kv) * bmm1_scale and the output (P . V) * bmm2_scale, in bf16.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from paged_standin_ref import CALLS, attend, int32_lens, int32_table, need

__refmla_standin__ = True


def trtllm_batch_decode_with_kv_cache_mla(
    query: torch.Tensor, kv_cache: torch.Tensor, workspace_buffer: torch.Tensor, qk_nope_head_dim: int,
    kv_lora_rank: int, qk_rope_head_dim: int, block_tables: torch.Tensor, seq_lens: Optional[torch.Tensor],
    max_seq_len: int, sparse_mla_top_k: int = 0, out: Optional[torch.Tensor] = None,
    bmm1_scale: Union[float, torch.Tensor] = 1.0, bmm2_scale: Union[float, torch.Tensor] = 1.0,
    sinks=None, enable_pdl=None, backend: str = "auto", lse: Optional[torch.Tensor] = None, return_lse: bool = False,
):  # fmt: skip
    need(query.dim() == 4 and query.shape[-1] == kv_lora_rank + qk_rope_head_dim, f"query must be [B, q_len, H, 576], got {list(query.shape)}")
    B, q_len, H, _ = query.shape
    cache = kv_cache.squeeze(1) if kv_cache.dim() == 4 else kv_cache
    need(cache.dim() == 3 and cache.shape[1] in (32, 64), f"kv_cache pages must hold 32 or 64 rows, got {list(kv_cache.shape)}")
    need(workspace_buffer.dtype == torch.uint8 and not bool(workspace_buffer[:64].any()), "workspace_buffer must be zeroed bytes")
    need((kv_lora_rank, qk_rope_head_dim) == (512, 64), "MLA 512 + 64 only")
    need(sparse_mla_top_k == 0 and q_len == 1, "dense one-token decode only in the stand-in")
    int32_table("block_tables", block_tables, B)
    int32_lens("seq_lens", seq_lens, B)
    need(int(seq_lens.max()) <= max_seq_len, f"max_seq_len {max_seq_len} is below a seq_len")
    fp8 = cache.dtype == torch.float8_e4m3fn
    need(not fp8 or query.dtype == cache.dtype, f"an fp8 cache wants an fp8 query, got {query.dtype}")
    need(fp8 or query.dtype in (torch.bfloat16, torch.float16), f"query must be bf16 / fp16 (or fp8 with an fp8 cache), got {query.dtype}")
    o, l = attend(query[:, 0].float(), cache.float(), block_tables, seq_lens, float(bmm1_scale))
    o = (o.float() * float(bmm2_scale)).to(torch.bfloat16 if fp8 else query.dtype)[:, None]
    CALLS.append({"kernel": "trtllm_batch_decode_with_kv_cache_mla", "B": B, "H": H, "page": cache.shape[1]})
    return (o, l) if return_lse else o
