"""``fa3_mla``: FlashAttention 3 as MLA decode, V the latent (``qv``), as vLLM's FLASH_ATTN_MLA calls it.

``vllm.vllm_flash_attn.flash_attn_varlen_func(q=q_pe [T, H, 64], k=k_pe [pages, P, 1, 64],
v=c_kv [pages, P, 1, 512], q_v=q_nope [T, H, 512], max_seqlen_q, cu_seqlens_q, max_seqlen_k,
seqused_k, block_table, softmax_scale, causal=True, return_softmax_lse, fa_version=3)``: the
scores are q_pe . k_pe + q_nope . c_kv, the output P . c_kv. Pages of a multiple of 16 rows.
Returns (out [T, H, 512], lse [H, T] or [T, H], natural log).
"""

from __future__ import annotations

import torch

from refmla.backends.calling import kwargs_for
from refmla.backends.paged.inputs import PagedInputs, PagedKernelBackend, call_result


class FA3MLABackend(PagedKernelBackend):
    name = "fa3_mla"
    modules = ("vllm.vllm_flash_attn",)
    attr = "flash_attn_varlen_func"
    what = "FlashAttention 3 MLA (qv)"
    page_sizes = (16, 32, 64, 128, 256)
    fp8_why = ("vLLM's FLASH_ATTN_MLA takes bf16 / fp16 caches only (no fp8 KV dtype); SGLang's FA3 MLA casts "
               "an fp8 pool to q's dtype before the kernel")  # fmt: skip

    def call(self, fn, x: PagedInputs, cap):
        m = cap.meta
        Dv, B, H = m.kv_lora_rank, x.q.shape[0], x.q.shape[1]
        values = dict(
            q=x.q[..., Dv:].contiguous(), k=x.pool[..., Dv:].unsqueeze(-2), v=x.pool[..., :Dv].unsqueeze(-2),
            q_v=x.q[..., :Dv].contiguous(), max_seqlen_q=1,
            cu_seqlens_q=torch.arange(B + 1, dtype=torch.int32, device=x.q.device),
            max_seqlen_k=int(x.seq_lens.max()) if B else 0, seqused_k=x.seq_lens, block_table=x.block_table,
            softmax_scale=m.sm_scale, causal=True, return_softmax_lse=True, fa_version=3,
        )  # fmt: skip
        out, lse = call_result(fn(**kwargs_for(fn, values, aliases={"qv": "q_v"})), None)
        if lse is not None and lse.shape == (H, B):
            lse = lse.transpose(0, 1)
        return out.reshape(B, H, Dv), lse


__all__ = ["FA3MLABackend"]
