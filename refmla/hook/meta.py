"""The capture's ``meta``, assembled from meta providers: small functions of the call context.

A provider takes the :class:`~refmla.hook.call.CallContext` (filled: indices, pool, schedule)
and returns a dict of meta keys (empty when it has nothing to say); :func:`assemble` merges
:data:`META_PROVIDERS` and then the mode reader's own providers, in order. New meta groups are
new providers appended here, for example:

* KV pool geometry (pool row count, bytes per row, layers per registered buffer, the
  disaggregation backend, ``SGLANG_MORI_MAX_MR_BYTES``): :func:`pool_geometry_meta`, reading
  ``ctx.pool`` / ``ctx.k_buf``, the server args and the environment (:mod:`refmla.hook.geometry`);
* which aiter kernel path SGLang dispatched (persistent / non-persistent / gluon, head padding,
  the env vars) is :func:`refmla.hook.aiter_meta.aiter_path_meta`, from the probes in
  :mod:`refmla.hook.kernel_probes` (``ctx.call.kernel_notes``).

Keys the contract does not name go to ``Capture.meta.extra`` when read back (docs/contract.md).
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable

import torch

from refmla.hook.aiter_meta import aiter_path_meta
from refmla.hook.call import CallContext
from refmla.hook.geometry import buffer_geometry, disagg_meta, pool_counts, registered_regions
from refmla.hook.runtime import versions
from refmla.util import dtype_name

MetaProvider = Callable[[CallContext], dict[str, Any]]


def _scale(layer, name: str) -> float:
    """k_scale / v_scale as the kernel applies them (``layer.k_scale_float``), 1.0 when unset."""
    if getattr(layer, name, None) is None:
        return 1.0
    value = getattr(layer, name + "_float", None)
    if value is None:
        value = getattr(layer, name)
        value = float(value.item()) if hasattr(value, "item") else float(value)
    return float(value)


def _tool_version() -> str:
    try:
        from refmla import __version__

        return f"refmla.hook {__version__}"
    except Exception:
        return "refmla.hook"


def mode_name(fm) -> str:
    """SGLang's ForwardMode as a name (DECODE, EXTEND, ...), whatever enum kind it is."""
    return str(getattr(fm, "name", fm)) if fm is not None else ""


def attention_meta(ctx: CallContext) -> dict[str, Any]:
    """The attention as the kernel got it: mode, backend, geometry, scales, page size."""
    layer, D, r = ctx.layer, ctx.qk_head_dim, ctx.kv_lora_rank
    return {
        "mode": ctx.call.mode,
        "backend": ctx.call.backend,
        "kv_lora_rank": r,
        "qk_rope_head_dim": D - r,
        "sm_scale": float(layer.scaling),
        "logit_cap": float(getattr(layer, "logit_cap", 0.0) or 0.0),
        "page_size": int(getattr(ctx.backend, "page_size", None) or getattr(ctx.pool, "page_size", 1) or 1),
        "k_scale": _scale(layer, "k_scale"),
        "v_scale": _scale(layer, "v_scale"),
    }


def origin_meta(ctx: CallContext) -> dict[str, Any]:
    """Where and when: layer, rank, step, versions, SGLang's class and forward mode, process."""
    call = ctx.call
    return {
        "layer_id": call.layer_id,
        "tp_rank": call.rank,
        "step": call.step,
        **versions(),
        "capture_tool": _tool_version(),
        "sglang_class": f"{type(ctx.backend).__module__}.{type(ctx.backend).__qualname__}",
        "forward_mode": mode_name(getattr(ctx.forward_batch, "forward_mode", None)),
        "pid": os.getpid(),
        "captured_at": time.time(),
        "kv_pool_dtype": dtype_name(ctx.k_buf.dtype),
    }


def notes_meta(ctx: CallContext) -> dict[str, Any]:
    """What the stages noted on the way (the Triton decode path: decode_kernel, forced splits)."""
    return dict(ctx.notes)


def seq_lens_meta(ctx: CallContext) -> dict[str, Any]:
    """``seq_lens_mismatch`` / ``server_seq_lens`` when the batch's seq_lens differ from what was attended."""
    B, server_lens = ctx.batch_size, getattr(ctx.forward_batch, "seq_lens", None)
    if server_lens is None or server_lens.shape[0] < B:
        return {}
    sl = server_lens[:B].to("cpu", torch.int64)
    if torch.equal(sl, ctx.seq_lens.long()):
        return {}
    return {"seq_lens_mismatch": True, "server_seq_lens": sl.tolist()}


def aiter_meta(ctx: CallContext) -> dict[str, Any]:
    """aiter: the split count its MLA metadata carries (``aiter_num_kv_splits``)."""
    if ctx.call.backend == "aiter" and isinstance(getattr(ctx.md, "num_kv_splits", None), int):
        return {"aiter_num_kv_splits": ctx.md.num_kv_splits}
    return {}


def triton_decode_meta(ctx: CallContext) -> dict[str, Any]:
    """Triton decode: ``max_kv_splits`` (the partials' S dimension as allocated)."""
    if ctx.call.backend == "triton" and getattr(ctx.backend, "max_kv_splits", None):
        return {"max_kv_splits": int(ctx.backend.max_kv_splits)}
    return {}


def rids_meta(ctx: CallContext) -> dict[str, Any]:
    """SGLang's request ids of the batch, for pairing prefill and decode captures."""
    B, rids = ctx.batch_size, getattr(ctx.forward_batch, "rids", None)
    if rids is not None and len(rids) >= B:
        return {"rids": [str(r) for r in list(rids)[:B]]}
    return {}


def verify_meta(ctx: CallContext) -> dict[str, Any]:
    """verify: ``verify_kind`` (target_verify / draft_extend), and from ``spec_info``
    ``draft_token_num`` (target_verify, when every request has that many queries) and ``topk``."""
    fb = ctx.forward_batch
    fm = getattr(fb, "forward_mode", None)
    target = bool(fm is not None and hasattr(fm, "is_target_verify") and fm.is_target_verify())
    out: dict[str, Any] = {"verify_kind": "target_verify" if target else "draft_extend"}
    spec = getattr(fb, "spec_info", None)
    qo = ctx.idx.qo_indptr if ctx.idx is not None else None
    n = getattr(spec, "draft_token_num", None)
    if target and isinstance(n, int) and qo is not None and bool(((qo[1:] - qo[:-1]) == n).all()):
        out["draft_token_num"] = n
    topk = getattr(spec, "topk", None)
    if isinstance(topk, int) and topk >= 1:
        out["topk"] = topk
    return out


def pool_geometry_meta(ctx: CallContext) -> dict[str, Any]:
    """What decides the size of a registered KV region (refmla.region_check): rows, row bytes, layers per
    buffer, the pool's capacity, the disaggregation mode and backend, SGLANG_MORI_MAX_MR_BYTES."""
    return {**buffer_geometry(ctx.pool, ctx.k_buf), **pool_counts(ctx.pool), **registered_regions(ctx.pool),
            **disagg_meta()}


META_PROVIDERS: tuple[MetaProvider, ...] = (
    attention_meta, origin_meta, notes_meta, seq_lens_meta, aiter_meta, rids_meta, aiter_path_meta,
    pool_geometry_meta,
)  # fmt: skip


def assemble(ctx: CallContext, mode_providers: tuple[MetaProvider, ...] = ()) -> dict[str, Any]:
    """One ``meta`` dict: the common providers, then the mode's; a later key wins."""
    meta: dict[str, Any] = {}
    for provider in META_PROVIDERS + tuple(mode_providers):
        meta.update(provider(ctx))
    return meta
