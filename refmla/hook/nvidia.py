"""SGLang's NVIDIA MLA decode backends: what each one's kernel read, and the scales it applied.

Checked against SGLang 0.5.23 (``sglang.srt.layers.attention``); every attribute is read with a
fall-back, a backend whose metadata is not the one known here is a :class:`Skip`, never a raise.

| backend | class | metadata | what the kernel reads | page | KV scales applied on an fp8 pool |
| --- | --- | --- | --- | --- | --- |
| ``flashmla`` | ``FlashMLABackend`` | ``forward_metadata`` | ``block_kv_indices [B, M]``, ``forward_batch.seq_lens`` | ``page_size`` (64) | ``descale_k = layer.k_scale`` for K and V (q quantized by it too) |
| ``trtllm_mla`` | ``TRTLLMMLABackend`` | ``forward_batch.decode_trtllm_mla_metadata`` or ``forward_decode_metadata`` | ``block_kv_indices``, ``seq_lens_k`` else ``forward_batch.seq_lens`` | ``page_size`` (32 / 64) | ``bmm1_scale = k_scale_float * sm_scale``; no ``bmm2_scale`` (V: 1.0) |
| ``flashinfer_mla`` | ``FlashInferMLAAttnBackend`` | ``forward_metadata.decode_wrapper`` (its plan) | token-level ``kv_indptr`` / ``kv_indices`` of the plan, page 1 | 1 | none: the pool is cast to q's dtype |
| ``fa3_mla`` | ``FlashAttentionBackend`` (``use_mla``) | ``forward_metadata`` | ``page_table [B, M]``, ``cache_seqlens_int32`` | ``page_size`` | ``k_descale`` / ``v_descale`` only when ``head_dim <= 256`` (never for 576) |

SGLang 0.5.23 has no ``cutlass_mla_backend.py``: CUTLASS MLA is not among its backends (its
``cutedsl_mla`` backend reuses the TRT-LLM decode metadata; it is not wrapped here).

The query: TRT-LLM, FlashInfer and FA3 take ``q`` (the latent part) and ``q_rope`` apart; the
capture's ``q`` is their concatenation ``[q_nope | q_rope]`` ([B, H, D]), as the kernel scores it.
The torch side of the hook.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from refmla import blocktable
from refmla.hook.call import CallContext, Indices, Skip

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _layer_scale(layer: Any, name: str) -> Optional[float]:
    """The layer's ``k_scale`` / ``v_scale`` as a float, None when the checkpoint has none."""
    value = getattr(layer, name + "_float", None)
    if value is None and getattr(layer, name, None) is not None:
        raw = getattr(layer, name)
        value = raw.item() if hasattr(raw, "item") else raw
    return float(value) if value is not None else None


@dataclass(frozen=True)
class NvidiaBackend:
    """How one NVIDIA backend's decode is read (all functions of the call context)."""

    metadata: Callable[[Any, Any], Any]  # (backend object, forward_batch) -> the metadata its decode read
    indices: Callable[[CallContext], Indices]  # the token slots; sets ctx.block_table / ctx.page_size
    scales: Callable[[CallContext], tuple[float, float]]  # (k, v) the kernel applied to an fp8 pool
    kernel_q_dtype: Callable[[CallContext], Optional[torch.dtype]] = lambda ctx: None  # q as the kernel got it


def table_indices(ctx: CallContext, table: torch.Tensor, seq: torch.Tensor, page: int) -> Indices:
    """Token slots of a block table ``[B, M]`` of pages of ``page`` rows over ``seq [B]``; the table
    and page size kept on ``ctx`` for the capture (refmla.blocktable.token_rows)."""
    B = ctx.q.shape[0]
    table, seq = table[:B].to("cpu", torch.int64), seq[:B].to("cpu", torch.int64)  # [B, M], [B]
    if table.dim() != 2 or table.shape[0] != B or seq.shape[0] != B:
        raise Skip(f"block table {list(table.shape)} / seq_lens {list(seq.shape)} for {B} requests")
    found = blocktable.problems(table, seq, page, ctx.pool.get_key_buffer(ctx.layer.layer_id).shape[0])
    if found.errors:
        raise Skip("block table: " + found.text(found.errors))
    ctx.block_table, ctx.page_size = table, int(page)
    kv_indptr, kv_indices = blocktable.token_rows(table, seq, page)
    return Indices(kv_indptr.long(), kv_indices, None, B)


def _page(ctx: CallContext) -> int:
    return int(getattr(ctx.backend, "page_size", 1) or 1)


def _forward_metadata(backend: Any, forward_batch: Any) -> Any:
    return getattr(backend, "forward_metadata", None)


def _fp8_pool(ctx: CallContext) -> bool:
    return ctx.pool.get_key_buffer(ctx.layer.layer_id).dtype in FP8


# -- FlashMLA -----------------------------------------------------------------------------------


def flashmla_indices(ctx: CallContext) -> Indices:
    table = getattr(ctx.md, "block_kv_indices", None)
    if table is None:
        raise Skip("FlashMLA metadata without block_kv_indices")
    return table_indices(ctx, table, ctx.forward_batch.seq_lens, _page(ctx))


def flashmla_scales(ctx: CallContext) -> tuple[float, float]:
    scale = _layer_scale(ctx.layer, "k_scale") or 1.0  # descale_k: K and V alike
    return scale, scale


def flashmla_plan(sched: Any, num: Any, object_layout: str = "struct") -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """FlashMLA's tile-scheduler plan a decode read (refmla.flashmla_plan), as capture tensors and meta:
    ``sched`` / ``num`` the tensor API's tensors (layout ``block``), or ``sched`` a ``FlashMLASchedMeta``
    once filled (``object_layout``: ``struct`` when FlashMLA's own first call filled it, ``block`` when
    the engine put the tensor API's rows in it: vLLM's fp8 path); empty when there is none."""
    layout = "block"
    if sched is not None and not torch.is_tensor(sched):  # a FlashMLASchedMeta
        sched, num, layout = getattr(sched, "tile_scheduler_metadata", None), getattr(sched, "num_splits", None), object_layout
    if not (torch.is_tensor(sched) and torch.is_tensor(num)) or sched.dim() != 2 or sched.shape[-1] != 8:
        return {}, {}
    host = {"flashmla_tile_scheduler_metadata": sched.detach().to("cpu", torch.int32).clone(),
            "flashmla_num_splits": num.detach().reshape(-1).to("cpu", torch.int32).clone()}  # fmt: skip
    return host, {"flashmla_sched_layout": layout}


# -- TRT-LLM-gen MLA (FlashInfer's trtllm_batch_decode_with_kv_cache_mla) -------------------------


def trtllm_metadata(backend: Any, forward_batch: Any) -> Any:
    return getattr(forward_batch, "decode_trtllm_mla_metadata", None) or getattr(backend, "forward_decode_metadata", None)


def trtllm_indices(ctx: CallContext) -> Indices:
    md = ctx.md
    if getattr(md, "block_kv_indices", None) is None:
        raise Skip("TRT-LLM MLA decode metadata without block_kv_indices")
    seq = md.seq_lens_k if getattr(md, "seq_lens_k", None) is not None else ctx.forward_batch.seq_lens
    return table_indices(ctx, md.block_kv_indices, seq, _page(ctx))


def trtllm_scales(ctx: CallContext) -> tuple[float, float]:
    return (_layer_scale(ctx.layer, "k_scale") or 1.0), 1.0  # bmm1 only: no bmm2_scale is passed


def _fp8_query(ctx: CallContext) -> Optional[torch.dtype]:
    return ctx.pool.get_key_buffer(ctx.layer.layer_id).dtype if _fp8_pool(ctx) else None


# -- FlashInfer MLA (BatchMLAPagedAttentionWrapper, page 1) --------------------------------------


def flashinfer_indices(ctx: CallContext) -> Indices:
    """The plan the wrapper ran: ``_kv_indptr_buf`` / ``_kv_indices_buf`` (token slots, page 1)."""
    wrapper, B = getattr(ctx.md, "decode_wrapper", None), ctx.q.shape[0]
    indptr, indices = getattr(wrapper, "_kv_indptr_buf", None), getattr(wrapper, "_kv_indices_buf", None)
    if indptr is None or indices is None:
        raise Skip("FlashInfer MLA decode without a known plan (_kv_indptr_buf / _kv_indices_buf)")
    if int(getattr(wrapper, "_page_size", 1) or 1) != 1:
        raise Skip(f"FlashInfer MLA plan with page_size {wrapper._page_size} (SGLang plans page 1)")
    kv_indptr = indptr[: B + 1].to("cpu", torch.int64)  # [B + 1]
    if kv_indptr.shape[0] != B + 1:
        raise Skip(f"FlashInfer MLA plan has {kv_indptr.shape[0]} kv_indptr entries for {B} requests")
    kv_indices = indices[int(kv_indptr[0]) : int(kv_indptr[-1])].to("cpu", torch.int64)
    ctx.page_size = 1
    return Indices(kv_indptr - kv_indptr[0], kv_indices, None, B)


# -- FA3 with qv (FlashAttentionBackend, use_mla) ------------------------------------------------


def fa3_indices(ctx: CallContext) -> Indices:
    md, be = ctx.md, ctx.backend
    if not getattr(be, "use_mla", False):
        raise Skip("FA3 backend without MLA (use_mla False)")
    if getattr(ctx.forward_batch, "spec_info", None) is not None and int(getattr(be, "topk", 1) or 1) > 1:
        raise Skip("FA3 cascade decode (speculative topk > 1): two kernels merged, not one call")
    if getattr(md, "local_attn_metadata", None) is not None:
        raise Skip("FA3 local (chunked) attention")
    if getattr(md, "page_table", None) is None or getattr(md, "cache_seqlens_int32", None) is None:
        raise Skip("FA3 metadata without page_table / cache_seqlens_int32")
    return table_indices(ctx, md.page_table, md.cache_seqlens_int32, _page(ctx))


def fa3_scales(ctx: CallContext) -> tuple[float, float]:
    be, layer = ctx.backend, ctx.layer
    fp8 = str(getattr(be, "kv_cache_dtype_str", "auto")) != "auto" and int(layer.qk_head_dim) <= 256
    if fp8 and getattr(layer, "k_scale", None) is not None:
        return _layer_scale(layer, "k_scale") or 1.0, _layer_scale(layer, "v_scale") or 1.0
    return 1.0, 1.0  # MLA's head_dim 576 > 256: the pool is cast to q's dtype, no descale


NVIDIA: dict[str, NvidiaBackend] = {
    "flashmla": NvidiaBackend(_forward_metadata, flashmla_indices, flashmla_scales, _fp8_query),
    "trtllm_mla": NvidiaBackend(trtllm_metadata, trtllm_indices, trtllm_scales, _fp8_query),
    "flashinfer_mla": NvidiaBackend(_forward_metadata, flashinfer_indices, lambda ctx: (1.0, 1.0)),
    "fa3_mla": NvidiaBackend(_forward_metadata, fa3_indices, fa3_scales),
}


def metadata(backend_name: str, backend: Any, forward_batch: Any) -> Any:
    """The metadata a backend's decode read (``forward_metadata`` for every other backend)."""
    spec = NVIDIA.get(backend_name)
    return spec.metadata(backend, forward_batch) if spec is not None else _forward_metadata(backend, forward_batch)


def full_query(q: torch.Tensor, q_rope: Optional[torch.Tensor], H: int, D: int, Dv: int) -> torch.Tensor:
    """``[q_nope | q_rope]`` [T, H, D] when the backend got them apart, else q as [T, H, D] (a view)."""
    if q_rope is None:
        return q.reshape(-1, H, D)
    return torch.cat([q.reshape(-1, H, Dv), q_rope.reshape(-1, H, D - Dv)], dim=-1)  # a copy: never written


def nvidia_meta(ctx: CallContext) -> dict[str, Any]:
    """The engine, the page size the kernel read, the dtypes, and the KV scales the kernel applied
    (``k_scale`` / ``v_scale``; on a non-fp8 pool none applies); the layer's own scales, when they
    differ, as ``layer_k_scale`` / ``layer_v_scale``."""
    spec = NVIDIA.get(ctx.call.backend)
    if spec is None:
        return {}
    pool = ctx.k_buf.dtype
    out: dict[str, Any] = {"engine": "sglang", "engine_backend": type(ctx.backend).__name__,
                           "page_size": int(ctx.page_size or 1), "q_dtype": str(ctx.q.dtype).replace("torch.", ""),
                           "kv_dtype": str(pool).replace("torch.", "")}  # fmt: skip
    kq = spec.kernel_q_dtype(ctx)
    if kq is not None:
        out["kernel_q_dtype"] = str(kq).replace("torch.", "")
    if pool in FP8:
        k, v = spec.scales(ctx)
        out.update(k_scale=float(k), v_scale=float(v))
        for name, applied in (("k_scale", k), ("v_scale", v)):
            given = _layer_scale(ctx.layer, name)
            if given is not None and given != applied:
                out["layer_" + name] = given
    return out


__all__ = ["NVIDIA", "NvidiaBackend", "full_query", "metadata", "nvidia_meta", "table_indices"]
