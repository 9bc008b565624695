"""``flashinfer_mla``: FlashInfer's TRT-LLM-gen MLA decode (``trtllm_batch_decode_with_kv_cache_mla``).

As vLLM's FLASHINFER_MLA and SGLang's trtllm_mla backend call it: query [B, q_len, H, 576],
kv_cache [pages, 1, P, 576] (P 32 or 64), a zeroed workspace, int32 block_tables and seq_lens,
max_seq_len, bmm1_scale = sm_scale (x q and k scales for fp8), bmm2_scale = 1 (x k scale).
``qk_nope_head_dim`` is unused by the kernel (FlashInfer marks it for removal); DeepSeek's 128 is
passed. Returns out [B, q_len, H, 512]; its lse is not requested (its base is not documented).

fp8 (e4m3) caches, as vLLM's FLASHINFER_MLA calls it: the query in e4m3 too, ``bmm1_scale =
sm_scale * q_scale * k_scale``, ``bmm2_scale = k_scale`` (one scale for the latent K and V).
"""

from __future__ import annotations

import torch

from refmla.backends.calling import kwargs_for
from refmla.backends.paged.inputs import PagedInputs, PagedKernelBackend, call_result, is_fp8, quantize_q

WORKSPACE_BYTES = 128 << 20  # vLLM's and SGLang's FlashInfer MLA workspace


class FlashInferMLABackend(PagedKernelBackend):
    name = "flashinfer_mla"
    modules = ("flashinfer.decode", "flashinfer.mla", "flashinfer")
    attr = "trtllm_batch_decode_with_kv_cache_mla"
    what = "FlashInfer TRT-LLM-gen MLA decode"
    page_sizes = (64, 32)
    fp8_attr = "trtllm_batch_decode_with_kv_cache_mla"  # the same entry point takes an fp8 cache

    def call(self, fn, x: PagedInputs, cap):
        m = cap.meta
        workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=x.q.device)
        query, bmm1, bmm2 = x.q, m.sm_scale, 1.0
        if is_fp8(cap):
            query, q_scale = quantize_q(x.q)
            bmm1, bmm2 = m.sm_scale * q_scale * m.k_scale, m.k_scale
        values = dict(
            query=query.unsqueeze(1).contiguous(), kv_cache=x.pool.unsqueeze(1), workspace_buffer=workspace,
            qk_nope_head_dim=128, kv_lora_rank=m.kv_lora_rank, qk_rope_head_dim=m.qk_rope_head_dim,
            block_tables=x.block_table, seq_lens=x.seq_lens, max_seq_len=int(x.seq_lens.max()) if len(x.seq_lens) else 0,
            bmm1_scale=bmm1, bmm2_scale=bmm2, return_lse=False,
        )  # fmt: skip
        out, _ = call_result(fn(**kwargs_for(fn, values)), None)
        return out.reshape(x.q.shape[0], x.q.shape[1], m.kv_lora_rank), None


__all__ = ["FlashInferMLABackend"]
