"""``flashmla``: FlashMLA's dense decode (``flash_mla_with_kvcache``, page 64), by its signature.

Where: DeepSeek's ``flash_mla`` package, or the copy vLLM vendors
(``vllm.v1.attention.ops.flashmla``, which binds the name to a raiser when its extension is not
built: reported as the skip reason). q [B, s_q, H, 576], k_cache [blocks, 64, 1, 576], int32
block_table and cache_seqlens, head_dim_v 512, the scheduler metadata of ``get_mla_metadata``:
no arguments in the current API (an empty FlashMLASchedMeta filled on first use), or
(cache_seqlens, s_q * H / H_kv, H_kv) -> (tile_scheduler_metadata, num_splits) before it.
Returns out [B, s_q, H, 512] and lse [B, H, s_q] fp32 (natural log).

fp8 (e4m3) caches: vLLM's ``flash_mla_with_kvcache_fp8(q, k_cache, block_table, cache_seqlens,
head_dim_v, tile_scheduler_metadata, num_splits, softmax_scale, causal, descale_q, descale_k)``
with the plan of ``get_mla_metadata_dense_fp8(cache_seqlens, num_q_tokens_per_head_k,
num_heads_k)``, as vLLM's FLASHMLA calls it: q in e4m3 too, ``descale_q`` / ``descale_k`` fp32
[1] (one scale for the latent K and V); out in bf16.
"""

from __future__ import annotations

import inspect
import sys

import torch

from refmla.backends.calling import kwargs_for
from refmla.backends.paged.inputs import PagedInputs, PagedKernelBackend, call_result, is_fp8, quantize_q


def scheduler_metadata(get_mla_metadata, seq_lens: torch.Tensor, heads: int):
    """(tile_scheduler_metadata, num_splits) under either get_mla_metadata API."""
    params = inspect.signature(get_mla_metadata).parameters
    if "cache_seqlens" in params:  # the first API: the split plan is computed here
        return get_mla_metadata(cache_seqlens=seq_lens, num_q_tokens_per_head_k=heads, num_heads_k=1)
    return get_mla_metadata()[0], None


class FlashMLABackend(PagedKernelBackend):
    name = "flashmla"
    modules = ("flash_mla", "vllm.v1.attention.ops.flashmla")
    attr = "flash_mla_with_kvcache"
    what = "FlashMLA dense decode"
    page_sizes = (64,)
    fp8_attr = "flash_mla_with_kvcache_fp8"

    def call(self, fn, x: PagedInputs, cap):
        if is_fp8(cap):
            return self.call_fp8(fn, x, cap)
        m = cap.meta
        tile, splits = scheduler_metadata(getattr(sys.modules[fn.__module__], "get_mla_metadata"), x.seq_lens,
                                          x.q.shape[1])  # fmt: skip
        values = dict(
            q=x.q.unsqueeze(1).contiguous(), k_cache=x.pool.unsqueeze(2), block_table=x.block_table,
            cache_seqlens=x.seq_lens, head_dim_v=m.kv_lora_rank, tile_scheduler_metadata=tile,
            num_splits=splits, softmax_scale=m.sm_scale, causal=True,
        )  # fmt: skip
        out, lse = call_result(fn(**kwargs_for(fn, values)), None)
        return out[:, 0], (lse[:, :, 0] if lse is not None else None)  # [B, H, Dv], [B, H]

    def call_fp8(self, fn, x: PagedInputs, cap):
        m, dev = cap.meta, x.q.device
        plan = getattr(sys.modules[fn.__module__], "get_mla_metadata_dense_fp8")
        tile, splits = plan(**kwargs_for(plan, dict(cache_seqlens=x.seq_lens, num_q_tokens_per_head_k=x.q.shape[1],
                                                    num_heads_k=1)))  # fmt: skip
        q8, q_scale = quantize_q(x.q)  # [B, H, 576] e4m3
        values = dict(
            q=q8.unsqueeze(1).contiguous(), k_cache=x.pool.unsqueeze(2), block_table=x.block_table,
            cache_seqlens=x.seq_lens, head_dim_v=m.kv_lora_rank, tile_scheduler_metadata=tile, num_splits=splits,
            softmax_scale=m.sm_scale, causal=True, descale_q=torch.tensor([q_scale], dtype=torch.float32, device=dev),
            descale_k=torch.tensor([m.k_scale], dtype=torch.float32, device=dev),
        )  # fmt: skip
        out, lse = call_result(fn(**kwargs_for(fn, values)), None)
        return out[:, 0], (lse[:, :, 0] if lse is not None else None)


__all__ = ["FlashMLABackend", "scheduler_metadata"]
