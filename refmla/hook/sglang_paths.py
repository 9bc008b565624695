"""Where SGLang keeps what the hook touches, release by release; the one place to update when it moves.

Checked against SGLang 0.5.23; older paths are kept as fall-backs, newest first in every list:

| what | module | name |
| --- | --- | --- |
| Triton backend | ``sglang.srt.layers.attention.triton_backend`` | ``TritonAttnBackend`` |
| aiter backend | ``sglang.srt.layers.attention.aiter_backend`` | ``AiterAttnBackend`` |
| NVIDIA MLA backends (decode) | ``sglang.srt.layers.attention.{flashmla,trtllm_mla,flashinfer_mla}_backend``, ``.flashattention_backend`` | ``FlashMLABackend``, ``TRTLLMMLABackend``, ``FlashInferMLAAttnBackend``, ``FlashAttentionBackend`` (no CUTLASS MLA backend in 0.5.23) |
| Triton decode kernel | ``sglang.kernels.ops.attention.decode_attention`` (0.5.16+), ``sglang.srt.layers.attention.triton_ops.decode_attention`` (before) | ``_mla_launch_plan``, ``_decode_lean_attention_fwd`` (probed, optional), ``_MIN_BLOCK_KV`` |
| aiter MLA entry points | ``sglang.srt.layers.attention.aiter_backend``, ``aiter.mla`` | ``mla_decode_fwd``, ``mla_gluon_decode``, ``get_mla_metadata_v1``, ``get_mla_metadata_info_v1``, ``_use_persistent_mla_decode`` (probed, each optional) |
| DSA aiter decode (V3.2, ROCm) | ``sglang.srt.layers.attention.dsa_backend`` | ``DeepseekSparseAttnBackend._forward_aiter`` (refmla.hook.patching wraps it) |
| MLA KV writers (``kvwrite``) | ``sglang.srt.mem_cache.memory_pool``, ``...attention_forward_methods.forward_mla_rocm`` | ``MLATokenToKVPool.set_mla_kv_buffer`` / ``.set_kv_buffer``, ``fused_qk_rope_cat_and_cache_mla`` (aiter, ROCm) |
| DeepSeek-V4 packed KV writers (``kvwrite``) | ``sglang.srt.mem_cache.deepseek_v4_memory_pool`` | ``DeepSeekV4TokenToKVPool.set_swa_key_buffer`` / ``.set_extra_key_buffer`` (a pack), ``.set_swa_key_buffer_radix_fused`` / ``.set_extra_key_buffer_fused`` (quantized by ``fused_store_cache``) |
| which V4 store quantizes | ``sglang.kernels.ops.attention.dsv4.attn``, ``sglang.kernels.ops.quantization.fp8_kernel`` | ``is_hip_runtime`` (ROCm: ``triton_fused_store_flashmla``), ``is_fp8_fnuz`` |
| state merges (``merge``) | ``sglang.srt.layers.attention.merge_state``, ``sglang.kernels.ops.attention.merge_state`` | ``merge_state``, ``merge_state_v2``, ``merge_state_triton`` |
| chunked-prefix MHA prefill (``merge``) | ``sglang.srt.models.deepseek_common.attention_forward_methods.forward_mha`` | ``DeepseekMHAForwardMixin.forward_normal_chunked_kv_core`` (its ``attn_mha`` calls and merges recorded) |
| graph-capture flag | ``sglang.srt.model_executor.runner_utils.capture_mode`` (0.5.x), ``sglang.srt.model_executor.cuda_graph_runner`` (0.4.x) | ``get_is_capture_mode`` |

``forward_decode`` and ``forward_extend`` take ``(q, k, v, layer, forward_batch,
save_kv_cache=True, ...)`` in every release seen, but gained and lost trailing parameters
(``sinks``, ``score_mod``, ...); the wrapper finds its arguments by name (:mod:`refmla.hook.patching`).
Nothing here imports SGLang.
"""

from __future__ import annotations

import sys
from typing import Any, Iterable, Optional

# backend name -> [(module, class)], newest first
BACKEND_CLASSES: dict[str, tuple[tuple[str, str], ...]] = {
    "triton": (("sglang.srt.layers.attention.triton_backend", "TritonAttnBackend"),),
    "aiter": (("sglang.srt.layers.attention.aiter_backend", "AiterAttnBackend"),),
    # NVIDIA (issue 20), decode only: what each decode read is refmla.hook.nvidia's (FlashMLA's
    # block_kv_indices at page 64, TRT-LLM's at 32 / 64, FlashInfer's page-1 plan, FA3's page_table)
    "flashmla": (("sglang.srt.layers.attention.flashmla_backend", "FlashMLABackend"),),
    "trtllm_mla": (("sglang.srt.layers.attention.trtllm_mla_backend", "TRTLLMMLABackend"),),
    "flashinfer_mla": (("sglang.srt.layers.attention.flashinfer_mla_backend", "FlashInferMLAAttnBackend"),),
    "fa3_mla": (("sglang.srt.layers.attention.flashattention_backend", "FlashAttentionBackend"),),
}
# backends wrapped in decode only (their forward_extend runs other kernels, or a parent's)
DECODE_ONLY = frozenset({"flashmla", "trtllm_mla", "flashinfer_mla", "fa3_mla"})
# modules whose aiter MLA entry points are probed (refmla.hook.kernel_probes): SGLang's backend module
# (it calls mla_decode_fwd, mla_gluon_decode, get_mla_metadata_*_v1 through its globals) and aiter.mla
# (its _use_persistent_mla_decode gate)
AITER_PROBED_MODULES = ("sglang.srt.layers.attention.aiter_backend", "aiter.mla")
DECODE_KERNEL_MODULES = (
    "sglang.kernels.ops.attention.decode_attention",
    "sglang.srt.layers.attention.triton_ops.decode_attention",
)
DCP_COMBINE_MODULES = ("sglang.srt.layers.attention.triton_backend",)  # cp_lse_ag_out_rs_mha, called in forward_decode under DCP
CAPTURE_MODE_PROBES = (
    ("sglang.srt.model_executor.runner_utils.capture_mode", "get_is_capture_mode"),
    ("sglang.srt.model_executor.cuda_graph_runner", "get_is_capture_mode"),
)
# capture mode -> method wrapped; speculative verify passes run through forward_extend too
METHODS = {"decode": "forward_decode", "extend": "forward_extend", "verify": "forward_extend"}
# the MLA KV cache writers (REFMLA_CAPTURE_BACKENDS=kvwrite, refmla.hook.kvwrite_call) and the state
# merges (=merge, refmla.hook.merge_call): module -> [(class or None for a module function, name, reader)]
KV_WRITERS: dict[str, tuple[tuple[Optional[str], str, str], ...]] = {
    "sglang.srt.mem_cache.memory_pool": (("MLATokenToKVPool", "set_mla_kv_buffer", "sglang_pool"),
                                         ("MLATokenToKVPool", "set_kv_buffer", "sglang_pool")),
    # ROCm: the fused rope + quantize + cache write the DeepSeek attention calls through this global
    "sglang.srt.models.deepseek_common.attention_forward_methods.forward_mla_rocm": (
        (None, "fused_qk_rope_cat_and_cache_mla", "aiter_fused"),),
    # DeepSeek-V4 (refmla.hook.v4write_call): the pool methods its attention backend and compressors
    # call; set_swa_key_buffer_radix delegates to set_swa_key_buffer (captured once)
    "sglang.srt.mem_cache.deepseek_v4_memory_pool": (
        ("DeepSeekV4TokenToKVPool", "set_swa_key_buffer", "dsv4_swa_pack"),
        ("DeepSeekV4TokenToKVPool", "set_extra_key_buffer", "dsv4_extra_pack"),
        ("DeepSeekV4TokenToKVPool", "set_swa_key_buffer_radix_fused", "dsv4_swa_fused"),
        ("DeepSeekV4TokenToKVPool", "set_extra_key_buffer_fused", "dsv4_extra_fused")),
}  # fmt: skip
# DeepSeek-V4's quantizing store (fused_store_cache): ROCm runs triton_fused_store_flashmla (its tile
# amax floor EPS=1e-8, fp8 e4m3fnuz where is_fp8_fnuz()), CUDA the JIT FusedStoreCacheFlashMLAKernel
# (store.cuh: fmaxf(1e-4f, abs_max), e4m3fn); module -> the probe, and the floors
DSV4_STORE_PROBES = (("sglang.kernels.ops.attention.dsv4.attn", "is_hip_runtime"),
                     ("sglang.kernels.ops.quantization.fp8_kernel", "is_fp8_fnuz"))  # fmt: skip
DSV4_AMAX_FLOOR = {"cuda": 1e-4, "rocm_triton": 1e-8}
MERGES: dict[str, tuple[tuple[Optional[str], str, str], ...]] = {
    "sglang.srt.layers.attention.merge_state": ((None, "merge_state", "sglang"), (None, "merge_state_v2", "sglang")),
    "sglang.kernels.ops.attention.merge_state": ((None, "merge_state_triton", "sglang"),),
}
# the chunked-prefix MHA prefill core (=merge, refmla.hook.chunked_call): recorded whole around the
# merges above; the ROCm path (forward_mha_rocm.py) prepares q, k, v its own way and runs this core
CHUNKED_PREFILL: dict[str, tuple[tuple[Optional[str], str, str], ...]] = {
    "sglang.srt.models.deepseek_common.attention_forward_methods.forward_mha": (
        ("DeepseekMHAForwardMixin", "forward_normal_chunked_kv_core", "sglang"),),
}  # fmt: skip
# where the scheduler's requests meet the forward pass: ForwardBatch.init_new(batch, ...) reads batch.reqs
# (refmla.hook.requests records their token ids and prefix-cache tiers for the captured rows)
FORWARD_BATCH = ("sglang.srt.model_executor.forward_batch_info", "ForwardBatch", "init_new")
MARK = "__refmla_hook__"  # set on every function the hook puts into SGLang; holds the original


def loaded_module(names: Iterable[str]) -> Optional[Any]:
    """The first of ``names`` that is imported already, or None (never imports anything)."""
    return next((sys.modules[m] for m in names if m in sys.modules), None)
