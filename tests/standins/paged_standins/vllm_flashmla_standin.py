"""STAND-IN for vLLM's ``vllm.v1.attention.ops.flashmla`` dense fp8 decode (tests only). Not a kernel.

Written from vLLM 0.33.0's module: ``get_mla_metadata_dense_fp8(cache_seqlens, num_q_tokens_per_head_k,
num_heads_k)`` -> (tile_scheduler_metadata, num_splits) and ``flash_mla_with_kvcache_fp8(q, k_cache,
block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata, num_splits, softmax_scale=None,
causal=False, descale_q=None, descale_k=None)`` -> (out [B, s_q, H, 512] bf16, softmax_lse [B, H, s_q]
fp32), as vLLM's FLASHMLA calls it: q and k_cache [blocks, 64, 1, 576] in e4m3, descale_q / descale_k
fp32 [1] (descale_k dequantizes the latent K and V alike). A test places it in ``sys.modules`` under
that name.
"""

from __future__ import annotations

from typing import Optional

import torch

from paged_standin_ref import CALLS, attend, int32_lens, int32_table, need

__refmla_standin__ = True
E4M3 = torch.float8_e4m3fn


class _Plan(torch.Tensor):
    """Marks the tile metadata as coming from get_mla_metadata_dense_fp8."""


def get_mla_metadata_dense_fp8(cache_seqlens: torch.Tensor, num_q_tokens_per_head_k: int, num_heads_k: int):
    int32_lens("cache_seqlens", cache_seqlens, cache_seqlens.shape[0])
    need(num_heads_k == 1, f"MLA has one KV head, got num_heads_k={num_heads_k}")
    tile = torch.zeros(1, 8, dtype=torch.int32).as_subclass(_Plan)
    tile.q_tokens = num_q_tokens_per_head_k
    return tile, torch.zeros(cache_seqlens.shape[0] + 1, dtype=torch.int32)


def _descale(name: str, t) -> float:
    need(isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.shape == (1,), f"{name} must be fp32 [1]")
    return float(t[0])


def flash_mla_with_kvcache_fp8(
    q: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor, cache_seqlens: torch.Tensor, head_dim_v: int,
    tile_scheduler_metadata: torch.Tensor, num_splits: torch.Tensor, softmax_scale: Optional[float] = None,
    causal: bool = False, descale_q: Optional[torch.Tensor] = None, descale_k: Optional[torch.Tensor] = None,
):  # fmt: skip
    need(q.dim() == 4 and q.shape[-1] == 576 and q.dtype == E4M3, f"q must be e4m3 [B, s_q, H, 576], got {q.dtype} {list(q.shape)}")
    B, s_q, H, _ = q.shape
    need(k_cache.dtype == E4M3 and k_cache.dim() == 4 and k_cache.shape[1:3] == (64, 1), f"k_cache must be e4m3 [blocks, 64, 1, 576], got {k_cache.dtype} {list(k_cache.shape)}")
    need(head_dim_v == 512 and s_q == 1, "head_dim_v 512, one-token decode")
    need(isinstance(tile_scheduler_metadata, _Plan) and tile_scheduler_metadata.q_tokens == s_q * H,
         "tile_scheduler_metadata must come from get_mla_metadata_dense_fp8(cache_seqlens, s_q * H, 1)")
    need(num_splits.shape == (B + 1,), "num_splits must be [B + 1] from the same plan")
    int32_table("block_table", block_table, B)
    int32_lens("cache_seqlens", cache_seqlens, B)
    dq, dk = _descale("descale_q", descale_q), _descale("descale_k", descale_k)
    scale = softmax_scale if softmax_scale is not None else 576**-0.5
    o, lse = attend(q[:, 0].float() * dq, k_cache[:, :, 0].float() * dk, block_table, cache_seqlens, scale)
    CALLS.append({"kernel": "flash_mla_with_kvcache_fp8", "B": B, "H": H, "descale_k": dk})
    return o.to(torch.bfloat16)[:, None], lse[:, :, None]
