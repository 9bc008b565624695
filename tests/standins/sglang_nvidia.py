"""Stand-ins for SGLang 0.5.23's NVIDIA MLA decode backends, written from their real ``forward_decode``.

Each class has its real name and its real ``forward_decode`` signature, reads what the real body
reads (the metadata object, the block table or plan, the page size, the layer's scales) and
answers with a plain per-request loop (``helpers.dense_reference``, not refmla's reference) over
the rows its kernel would read, with the KV scales that kernel applies. ``MODULES`` maps SGLang's
module names to the classes, for a test to put into ``sys.modules``.

| class | reads | scales on an fp8 pool |
| --- | --- | --- |
| FlashMLABackend | forward_metadata.block_kv_indices[:bs], forward_batch.seq_lens, page 64 | descale_k = layer.k_scale (K and V) |
| TRTLLMMLABackend | forward_batch.decode_trtllm_mla_metadata or forward_decode_metadata: block_kv_indices, seq_lens_k | bmm1 k_scale_float, no bmm2 |
| FlashInferMLAAttnBackend | forward_metadata.decode_wrapper's plan (_kv_indptr_buf, _kv_indices_buf, _sm_scale), page 1 | none (pool cast to q's dtype) |
| FlashAttentionBackend | forward_metadata.page_table, cache_seqlens_int32, page_size | none (head_dim 576 > 256) |
"""

from __future__ import annotations

import types
from typing import Optional

import torch

from helpers import dense_reference

CALLS: list[dict] = []  # one entry per forward_decode: the class and what it read


def _table_rows(table: torch.Tensor, seq: torch.Tensor, page: int):
    """(kv_indptr, kv_indices) of a block table, by a plain loop."""
    rows, indptr = [], [0]
    for b in range(seq.shape[0]):
        L = int(seq[b])
        rows += [int(table[b, j // page]) * page + j % page for j in range(L)]
        indptr.append(len(rows))
    return torch.tensor(indptr), torch.tensor(rows, dtype=torch.int64)


def _query(q, q_rope, layer):
    H, D, Dv = layer.tp_q_head_num, layer.head_dim, layer.v_head_dim
    if q_rope is None:
        return q.reshape(-1, H, D)
    return torch.cat([q.reshape(-1, H, Dv), q_rope.reshape(-1, H, D - Dv)], dim=-1)


def _answer(name, q, pool, indptr, rows, layer, sm_scale, k_scale=1.0, v_scale=1.0):
    CALLS.append({"backend": name, "rows": rows.clone(), "k_scale": k_scale, "v_scale": v_scale})
    kv = pool.float()  # the fp8 pool as stored; the scales below are the kernel's
    out, _ = dense_reference(q.float(), kv, indptr, rows, layer.v_head_dim, sm_scale, k_scale=k_scale, v_scale=v_scale)
    return out.to(q.dtype).reshape(q.shape[0], -1)  # [B, H * Dv]


def _fp8(pool) -> bool:
    return pool.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


class FlashMLABackend:
    page_size = 64

    def forward_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer, forward_batch,
                       save_kv_cache: bool = True):  # fmt: skip
        bs = forward_batch.batch_size
        k_cache = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
        indptr, rows = _table_rows(self.forward_metadata.block_kv_indices[:bs], forward_batch.seq_lens, 64)
        scale = float(layer.k_scale.item()) if _fp8(k_cache) and layer.k_scale is not None else 1.0
        return _answer("flashmla", _query(q, None, layer), k_cache, indptr, rows, layer, layer.scaling, scale, scale)


class TRTLLMMLABackend:
    def forward_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer, forward_batch,
                       save_kv_cache: bool = True, q_rope: Optional[torch.Tensor] = None,
                       k_rope: Optional[torch.Tensor] = None, cos_sin_cache: Optional[torch.Tensor] = None,
                       is_neox: Optional[bool] = False, llama_4_scaling: Optional[torch.Tensor] = None) -> torch.Tensor:  # fmt: skip
        metadata = getattr(forward_batch, "decode_trtllm_mla_metadata", None) or self.forward_decode_metadata
        k_cache = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
        seq = metadata.seq_lens_k if metadata.seq_lens_k is not None else forward_batch.seq_lens
        indptr, rows = _table_rows(metadata.block_kv_indices, seq, self.page_size)
        k_scale = (layer.k_scale_float or 1.0) if self.data_type == torch.float8_e4m3fn else 1.0  # bmm1 only
        return _answer("trtllm_mla", _query(q, q_rope, layer), k_cache, indptr, rows, layer, layer.scaling, k_scale, 1.0)


class FlashInferMLAAttnBackend:
    def forward_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer, forward_batch,
                       save_kv_cache: bool = True, q_rope: Optional[torch.Tensor] = None,
                       k_rope: Optional[torch.Tensor] = None):  # fmt: skip
        w = self.forward_metadata.decode_wrapper
        k_buffer = self.token_to_kv_pool.get_key_buffer(layer.layer_id).to(q.dtype)  # no scale
        indptr, rows = w._kv_indptr_buf, w._kv_indices_buf
        return _answer("flashinfer_mla", _query(q, q_rope, layer), k_buffer, indptr, rows.long(), layer, w._sm_scale)


class FlashAttentionBackend:
    use_mla = True

    def forward_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer, forward_batch,
                       save_kv_cache=True, q_rope: Optional[torch.Tensor] = None, k_rope: Optional[torch.Tensor] = None,
                       sinks: Optional[torch.Tensor] = None, q_descale: Optional[torch.Tensor] = None,
                       k_descale: Optional[torch.Tensor] = None, v_descale: Optional[torch.Tensor] = None,
                       score_mod=None, aux_tensors=None, rel_bias=None, rel_bias_event=None,
                       return_lse: bool = False) -> torch.Tensor:  # fmt: skip
        md = self.forward_metadata
        kv_cache = self.token_to_kv_pool.get_key_buffer(layer.layer_id).to(q.dtype)
        indptr, rows = _table_rows(md.page_table, md.cache_seqlens_int32, self.page_size)
        return _answer("fa3_mla", _query(q, q_rope, layer), kv_cache, indptr, rows, layer, layer.scaling)


PREFIX = "sglang.srt.layers.attention."
MODULES = {
    PREFIX + "flashmla_backend": FlashMLABackend,
    PREFIX + "trtllm_mla_backend": TRTLLMMLABackend,
    PREFIX + "flashinfer_mla_backend": FlashInferMLAAttnBackend,
    PREFIX + "flashattention_backend": FlashAttentionBackend,
}


def modules() -> dict[str, types.ModuleType]:
    """Fresh modules under SGLang's names, each holding its stand-in class (a fresh subclass, so
    the hook's patch of one test never leaks into another)."""
    out = {}
    for name, cls in MODULES.items():
        mod = types.ModuleType(name)
        setattr(mod, cls.__name__, type(cls.__name__, (cls,), {"__module__": name, "forward_decode": cls.forward_decode}))
        out[name] = mod
    return out
