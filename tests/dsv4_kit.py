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
