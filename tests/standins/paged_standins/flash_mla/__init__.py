"""STAND-IN for DeepSeek's ``flash_mla`` (tests only). Not a kernel.

Written from FlashMLA's interface (the copy vLLM 0.33.0 vendors in
``vllm/third_party/flashmla/flash_mla_interface.py``): ``get_mla_metadata()`` returns
(FlashMLASchedMeta, None); ``flash_mla_with_kvcache(q [B, s_q, H, 576], k_cache [blocks, 64, 1,
576], block_table int32 [B, M], cache_seqlens int32 [B], head_dim_v=512, tile_scheduler_metadata,
num_splits=None, softmax_scale, causal, ...)`` -> (out [B, s_q, H, 512], softmax_lse [B, H, s_q]
fp32). Page 64 only, dense (no indices), one KV head.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from paged_standin_ref import CALLS, attend, int32_lens, int32_table, need

__refmla_standin__ = True  # refmla reports a stand-in as such; it runs on CPU


@dataclass
class FlashMLASchedMeta:
    have_initialized: bool = False


def get_mla_metadata(*args, **kwargs):
    return FlashMLASchedMeta(), None


def flash_mla_with_kvcache(
    q: torch.Tensor, k_cache: torch.Tensor, block_table: Optional[torch.Tensor], cache_seqlens: Optional[torch.Tensor],
    head_dim_v: int, tile_scheduler_metadata: FlashMLASchedMeta, num_splits: None = None,
    softmax_scale: Optional[float] = None, causal: bool = False, is_fp8_kvcache: bool = False,
    indices: Optional[torch.Tensor] = None, attn_sink: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None,
    enable_batch_invariant: bool = False,
):  # fmt: skip
    need(q.dim() == 4 and q.shape[-1] == 576, f"q must be [B, s_q, H, 576], got {list(q.shape)}")
    B, s_q, H, _ = q.shape
    need(k_cache.dim() == 4 and k_cache.shape[1] == 64 and k_cache.shape[2] == 1, f"k_cache must be [blocks, 64, 1, 576], got {list(k_cache.shape)}")
    need(head_dim_v == 512, f"head_dim_v must be 512, got {head_dim_v}")
    need(isinstance(tile_scheduler_metadata, FlashMLASchedMeta), "tile_scheduler_metadata must come from get_mla_metadata")
    need(num_splits is None, "num_splits must be None in this API")
    need(indices is None and not is_fp8_kvcache, "dense bf16 decode only")
    need(s_q == 1, "the stand-in covers decode (s_q == 1)")
    int32_table("block_table", block_table, B)
    int32_lens("cache_seqlens", cache_seqlens, B)
    scale = softmax_scale if softmax_scale is not None else 576**-0.5
    o, lse = attend(q[:, 0], k_cache[:, :, 0], block_table, cache_seqlens, scale)
    CALLS.append({"kernel": "flash_mla_with_kvcache", "B": B, "H": H, "causal": causal})
    return o[:, None].to(q.device), lse[:, :, None].to(q.device)  # [B, 1, H, 512], [B, H, 1]
