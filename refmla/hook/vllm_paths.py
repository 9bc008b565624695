"""Where vLLM keeps its MLA decode implementations, and what each is called in a capture.

Every vLLM MLA backend reaches its kernel through ``<Impl>.forward_mqa(q, kv_c_and_k_pe_cache,
attn_metadata, layer)`` (vLLM >= 0.11; ``_forward_decode`` before), called from
``MLAAttention.forward_impl``. Torch-free: read when the hook is installed.
"""

from __future__ import annotations

PREFIX = "vllm.v1.attention.backends.mla."
# module -> (Impl class, vLLM's backend name, the capture's meta backend)
VLLM_IMPLS = {
    PREFIX + "triton_mla": ("TritonMLAImpl", "TRITON_MLA", "vllm_triton"),
    PREFIX + "rocm_aiter_mla": ("AiterMLAImpl", "ROCM_AITER_MLA", "aiter"),
    PREFIX + "aiter_triton_mla": ("AiterTritonMLAImpl", "AITER_TRITON_MLA", "aiter"),
    PREFIX + "flashmla": ("FlashMLAImpl", "FLASHMLA", "flashmla"),
    PREFIX + "cutlass_mla": ("CutlassMLAImpl", "CUTLASS_MLA", "cutlass_mla"),
    PREFIX + "flashinfer_mla": ("FlashInferMLAImpl", "FLASHINFER_MLA", "flashinfer_mla"),
    PREFIX + "flashattn_mla": ("FlashAttnMLAImpl", "FLASH_ATTN_MLA", "fa3_mla"),
}
# the KV cache writer and the state merge (REFMLA_CAPTURE_BACKENDS=kvwrite / merge): as in sglang_paths
VLLM_KV_WRITERS = {"vllm._custom_ops": ((None, "concat_and_cache_mla", "vllm_concat"),)}
VLLM_MERGES = {"vllm.v1.attention.ops.merge_attn_states": ((None, "merge_attn_states", "vllm"),)}
METHODS = ("forward_mqa", "_forward_decode")  # the decode entry, newest name first
MARK = "_refmla_vllm_original"  # set on our wrappers: wrapping twice is a no-op

__all__ = ["MARK", "METHODS", "VLLM_IMPLS", "VLLM_KV_WRITERS", "VLLM_MERGES"]
