"""SGLang's real DeepSeek-V4 KV pool on a CPU, for the region check's tests.

Real: ``DeepSeekV4TokenToKVPool`` (SGLang 0.5.23) with its sub-pools (SWA, C4 KV, C4 indexer,
C128 KV) allocated as CPU tensors. Stand-in: the model runner and server args, which SGLang's own
DSV4 attention test kit (``sglang.test.kits.attention_unittest.attention_methods.dsv4_attention``)
provides as ``MockDSV4ModelRunner`` / ``TinyDSV4ModelConfig`` (imported, not copied).
"""

from __future__ import annotations

import importlib
from typing import Any

from sglang_kit import Unavailable, prepare

DSV4_KIT = "sglang.test.kits.attention_unittest.attention_methods.dsv4_attention"


def dsv4_kit():
    """SGLang's DSV4 attention test kit, or Unavailable with the reason."""
    prepare()
    try:
        return importlib.import_module(DSV4_KIT)
    except Exception as e:
        raise Unavailable(f"{DSV4_KIT} not importable: {type(e).__name__}: {e}") from e


def token_to_kv_pool(compression_ratios: list[int], num_heads: int = 8, swa_size: int = 1024) -> Any:
    """SGLang's ``DeepSeekV4TokenToKVPool`` for these layer ratios (page size 256, CPU tensors)."""
    import torch

    K = dsv4_kit()
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    case = K.DSV4AttentionCase(name="refmla_regions", backend="dsv4", forward_mode=ForwardMode.DECODE,
                               num_heads=num_heads, page_size=K.DSV4_PAGE_SIZE, prefix_lens=(10,))  # fmt: skip
    cfg = K.TinyDSV4ModelConfig(num_heads=num_heads, context_len=swa_size, compression_ratios=list(compression_ratios))
    try:
        runner = K.MockDSV4ModelRunner(case=case, model_config=cfg, dtype=torch.bfloat16, device="cpu",
                                       max_context_len=swa_size, swa_size=swa_size,
                                       compression_ratios=list(compression_ratios))  # fmt: skip
    except Exception as e:
        raise Unavailable(f"DeepSeekV4TokenToKVPool cannot be built on CPU: {type(e).__name__}: {e}") from e
    return runner.token_to_kv_pool


# --- DeepSeek-V4's packed KV writers on a CPU (tests/test_v4write.py, tools/capture_v4_writer_e2e.py) ---

STORE_MODULE = "sglang.kernels.ops.attention.dsv4.attn"  # fused_store_cache's dispatch: is_hip_runtime()
TILE_MAGNITUDES = (2.0, 0.03, 7.0, 1.0, 0.0, 1e-6, 300.0, 3.0)  # 7 nope tiles (one all zero, one under
# the 1e-4 amax floor) and the rope part


def v4_latent(tokens: int, seed: int = 0) -> Any:
    """[tokens, 512] bf16: 448 nope values in tiles of different magnitudes, then 64 rope values."""
    import torch

    g = torch.Generator().manual_seed(seed)
    mag = torch.tensor(TILE_MAGNITUDES).repeat_interleave(64)
    return (torch.randn(tokens, 512, generator=g) * mag).bfloat16()


def pack_quantizer() -> Any:
    """SGLang's own Triton quantizer of the V4 pack (its test kit's, what its DSV4 tests write with)."""
    from refmla.backends.triton_interp import install_bf16_dot_fix, interpreter_active

    if interpreter_active():
        ok, note = install_bf16_dot_fix()  # the interpreter's fp -> fp8 cast rounds wrong without it
        if not ok:
            raise Unavailable(note)
    try:
        from sglang.test.kernels.deepseek_v4.k_cache_reference import quant_to_nope_fp8_rope_bf16_pack_triton
    except Exception as e:
        raise Unavailable(f"SGLang's V4 pack quantizer not importable: {type(e).__name__}: {e}") from e
    return quant_to_nope_fp8_rope_bf16_pack_triton


def rocm_store(on: bool = True) -> None:
    """fused_store_cache's ROCm path (SGLang's triton_fused_store_flashmla, interpreted here) instead of
    its CUDA JIT kernel, which a CPU cannot build: SGLang's own is_hip_runtime switch, set in its module
    (``on=False`` restores it)."""
    import importlib

    mod = importlib.import_module(STORE_MODULE)
    if on and not hasattr(mod, "_refmla_is_hip_runtime"):
        mod._refmla_is_hip_runtime = mod.is_hip_runtime
        mod.is_hip_runtime = lambda: True
    elif not on and hasattr(mod, "_refmla_is_hip_runtime"):
        mod.is_hip_runtime = mod.__dict__.pop("_refmla_is_hip_runtime")


def write_v4(pool: Any, tokens: int = 6, seed: int = 0) -> dict:
    """The four V4 writer methods, as SGLang's backend and compressors call them, at shuffled slots
    (one at a page's last slot): the pack into the SWA pool (through set_swa_key_buffer_radix) and into
    a C4 pool, bf16 quantized by fused_store_cache into the SWA pool and a C128 pool. Layers: 0 SWA
    only, 1 C4, 2 C128 (token_to_kv_pool([0, 4, 128]))."""
    import torch

    k = v4_latent(tokens, seed)
    pack = pack_quantizer()(k)
    g = torch.Generator().manual_seed(seed + 1)
    swa_rows = pool.swa_kv_pool.kv_buffer[0].shape[0] * pool.get_swa_key_page_size()
    c4, c128 = pool.layer_mapping[1][2], pool.layer_mapping[2][2]

    def slots(rows: int, last: int) -> torch.Tensor:
        s = (torch.randperm(rows // 3 - 2, generator=g)[: tokens - 1] * 3 + 2).tolist()
        return torch.tensor(s + [last], dtype=torch.int32)

    locs = {"swa_pack": slots(swa_rows, 255), "c4_pack": slots(c4.kv_buffer[0].shape[0] * c4.page_size, 63),
            "swa_fused": slots(swa_rows, 511), "c128_fused": slots(c128.kv_buffer[0].shape[0] * c128.page_size, 1)}
    pool.set_swa_key_buffer_radix(0, locs["swa_pack"], pack)
    pool.set_extra_key_buffer(1, locs["c4_pack"], pack)
    pool.set_swa_key_buffer_radix_fused(layer_id=1, swa_loc=locs["swa_fused"], cache_k=k)
    pool.set_extra_key_buffer_fused(layer_id=2, loc=locs["c128_fused"], cache_k=k)
    return {"latent": k, "pack": pack, "locs": locs}
