"""vLLM's real TRITON_MLA implementation on CPU, driven with metadata built here.

``TritonMLAImpl.forward_mqa`` (and the kernel it calls) is vLLM's own code; what is built here is
only what vLLM's model runner would hand it: a paged cache ``[blocks, page, 576]``, the decode
metadata (``MLACommonMetadata`` / ``MLACommonDecodeMetadata``, vLLM's dataclasses) and a layer
carrying ``_k_scale``. The impl is made without ``__init__`` (which wants a whole VllmConfig and
a device), with the attributes forward_mqa reads set as ``__init__`` sets them.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from types import SimpleNamespace

import pytest
import torch


def import_triton_mla():
    """vLLM's triton_mla module, importable here, or a pytest skip with the reason."""
    from refmla.backends.vllm_compat import vllm_triton_on_cpu

    seen, note = vllm_triton_on_cpu()
    if not seen:
        pytest.skip(f"vLLM's Triton kernels unavailable: {note}")
    try:
        import vllm.v1.attention.backends.mla.triton_mla as mod
    except Exception as e:
        pytest.skip(f"vllm triton_mla not importable: {type(e).__name__}: {e}")
    return mod


@dataclass
class VllmCase:
    seq_lens: tuple = (70, 1, 37)
    heads: int = 16
    page: int = 16
    q_len: int = 1  # query rows per request (multi-token decode when > 1)
    blocks: int = 24  # pool pages (block 0 is vLLM's null block)
    seed: int = 0
    dtype: torch.dtype = torch.bfloat16
    sm_scale: float = 0.1147


def build(case: VllmCase):
    """(impl, q [B * q_len, H, 576], cache [blocks, page, 576], metadata, layer)."""
    mod = import_triton_mla()
    from vllm.model_executor.layers.attention.mla_attention import MLACommonDecodeMetadata, MLACommonMetadata

    g = torch.Generator().manual_seed(case.seed)
    cache = torch.randn(case.blocks, case.page, 576, generator=g).to(case.dtype)
    cache[0] = float("nan")  # the null block: a correct kernel never reads it
    B, M = len(case.seq_lens), max(-(-L // case.page) for L in case.seq_lens) + 1
    perm = torch.randperm(case.blocks - 1, generator=g) + 1  # shuffled pages, never the null block
    table = torch.zeros(B, M, dtype=torch.int32)  # padding: the null block, as vLLM pads
    used = 0
    for b, L in enumerate(case.seq_lens):
        n = -(-L // case.page)
        table[b, :n] = perm[used : used + n]
        used += n
        if n:  # NaN in the tail of the last page, past the sequence
            tail = L - (n - 1) * case.page
            cache[int(table[b, n - 1]), tail:] = float("nan")
    seq = torch.tensor(case.seq_lens, dtype=torch.int32)
    rows = B * case.q_len
    q = (torch.randn(rows, case.heads, 576, generator=g) * 0.5).to(case.dtype)
    md = _metadata(MLACommonMetadata, MLACommonDecodeMetadata, table, seq, case.q_len)
    impl = object.__new__(mod.TritonMLAImpl)
    impl.kv_lora_rank, impl.scale, impl._sm_count, impl.dcp_world_size = 512, case.sm_scale, 132, 1
    impl.num_heads, impl.kv_cache_dtype = case.heads, "auto"
    layer = SimpleNamespace(_k_scale=torch.tensor(1.0), _k_scale_float=1.0, _v_scale_float=1.0,
                            layer_name="model.layers.3.self_attn.attn")  # fmt: skip
    return impl, q, cache, md, layer


def _metadata(common, decode_cls, table, seq, q_len):
    decode = decode_cls(block_table=table, seq_lens=seq, dcp_tot_seq_lens=None)
    B = seq.shape[0]
    values = dict(
        num_reqs=B, max_query_len=q_len, max_seq_len=int(seq.max()), num_actual_tokens=B * q_len,
        query_start_loc=torch.arange(0, B * q_len + 1, q_len, dtype=torch.int32), slot_mapping=torch.zeros(0),
        num_decodes=B, num_decode_tokens=B * q_len, num_prefills=0, decode=decode, prefill=None, causal=True,
    )  # fmt: skip
    names = {f.name for f in fields(common)}
    return common(**{k: v for k, v in values.items() if k in names})


__all__ = ["VllmCase", "build", "import_triton_mla"]
