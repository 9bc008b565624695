"""(torch) DeepSeek-V3.2 DSA decode on ROCm: SGLang 0.5.23's ``DeepseekSparseAttnBackend._forward_aiter``.

On HIP with ``dsa_decode_impl`` ``aiter`` the DSA backend reads the layer's plain MLA cache
(``kv_cache.view(-1, 1, 1, head_dim)``: 576 bf16 or fp8 values per token, one scalar
``layer.k_scale``, not FlashMLA's packed 656-byte layout) and calls aiter's ``mla_decode_fwd`` with
page size 1 over the indexer's top-k: ``kv_indices`` are each row of ``page_table_1`` with its -1
entries dropped (``get_valid_kv_indices``), ``kv_indptr`` their running counts. That is an absorbed
MLA decode over the selected token slots, so it is captured as a dense ``refmla.capture/1`` decode
capture (docs/contract.md section 1) that ``refmla replay`` runs through the reference, the Triton
decode and aiter as any decode capture: q as the kernel got it, the referenced rows only
(renumbered, ``orig_kv_indices`` the slots), the output, meta ``dsa_topk`` (the index width) and
``decode_kernel`` ``dsa_aiter_mla_decode_fwd``.

:func:`wrap_forward_aiter` returns the method the patcher installs: the original runs first and its
result is returned untouched; the capture reads (never writes) under the same filters and budgets
as every hook capture, a call the format cannot describe is a counted skip (several query tokens
per request, a sink, a q that is not [rows, H, D]), and any other exception disables the hook once,
logged (never raised into the server).
"""

from __future__ import annotations

import inspect
import os
from typing import Any, Callable, Optional

import torch

from refmla.hook.call import Skip, guarded
from refmla.hook.filters import after_call_filters
from refmla.hook.runtime import versions
from refmla.hook.writer import HookState, capture_name

ARGS = ("q_all", "kv_cache", "page_table_1", "layer", "metadata", "bs")  # _forward_aiter's parameters


def dsa_tensors(a: dict, out: torch.Tensor) -> dict[str, torch.Tensor]:
    """The capture's tensors from what ``_forward_aiter`` got (``a``, by parameter name) and
    returned (host copies): one query row and one index row per request, else a Skip."""
    layer, kv_cache = a["layer"], a["kv_cache"]
    H, D, Dv = int(layer.tp_q_head_num), int(layer.head_dim), int(layer.v_head_dim)
    q = a["q_all"].detach().reshape(-1, H, D)  # [rows, H, D]
    B = int(a["bs"]) if a["bs"] is not None else q.shape[0]
    if q.shape[0] != B or a["page_table_1"].shape[0] != B or out.numel() != B * H * Dv:
        raise Skip(f"DSA aiter call with {q.shape[0]} query rows, {a['page_table_1'].shape[0]} index rows for "
                   f"{B} requests (several query tokens per request)")  # fmt: skip
    table = a["page_table_1"].detach().to("cpu", torch.int64)  # [B, K] token slots, -1 invalid
    valid = table != -1
    slots = table[valid]  # [nnz] in row order, as get_valid_kv_indices lists them
    counts = valid.sum(dim=1)  # [B]
    used, renum = torch.unique(slots, return_inverse=True)
    rows = kv_cache.detach().reshape(-1, 1, D)  # [N, 1, D] the layer's cache, one row per token slot
    if slots.numel() and int(slots.max()) >= rows.shape[0]:
        raise Skip(f"a top-k slot {int(slots.max())} is past the layer's cache ({rows.shape[0]} rows)")
    return {
        "q": q.cpu(),
        "kv_buffer": rows.index_select(0, used.to(rows.device)).cpu(),
        "kv_indptr": torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)]).to(torch.int32),
        "kv_indices": renum.to(torch.int32),
        "orig_kv_indices": slots.to(torch.int32),
        "seq_lens": counts.to(torch.int32),
        "out": out.detach().reshape(B, H, Dv).cpu(),
    }


def dsa_meta(layer: Any, kv_cache: torch.Tensor, page_table_1: torch.Tensor, kv_scale: Optional[float]) -> dict:
    D, Dv = int(layer.head_dim), int(layer.v_head_dim)
    meta = {"mode": "decode", "backend": "aiter", "kv_lora_rank": Dv, "qk_rope_head_dim": D - Dv,
            "sm_scale": float(layer.scaling), "logit_cap": float(getattr(layer, "logit_cap", 0.0) or 0.0),
            "page_size": 1, "dsa_topk": int(page_table_1.shape[1]), "decode_kernel": "dsa_aiter_mla_decode_fwd",
            "kv_pool_dtype": str(kv_cache.dtype).replace("torch.", ""), "capture_tool": "refmla.hook.dsa_call"}  # fmt: skip
    if kv_scale is not None:
        meta["k_scale"] = meta["v_scale"] = kv_scale
    return meta


def _kv_scale(layer: Any, kv_cache: torch.Tensor) -> Optional[float]:
    """The scalar fp8 KV scale _forward_aiter passes (``layer.k_scale``; 1.0 when it has none)."""
    if kv_cache.element_size() != 1:
        return None
    s = getattr(layer, "k_scale", None)
    return float(s.reshape(())) if isinstance(s, torch.Tensor) else 1.0


def capture_dsa(state: HookState, a: dict, out: Any) -> None:
    """Filters, budget, host copy, write: one DSA aiter decode capture (or a counted skip)."""
    layer = a["layer"]
    layer_id = int(getattr(layer, "layer_id", -1))
    wanted = after_call_filters(state, "dsa", layer_id)
    if wanted is None:
        return None
    rank, step = wanted
    if not torch.is_tensor(out) or a["page_table_1"] is None or a["page_table_1"].dim() != 2:
        raise Skip("DSA aiter call without an output tensor or a [rows, topk] page_table_1")
    per_token = a["kv_cache"].element_size() * int(layer.head_dim)
    estimate = a["q_all"].numel() * a["q_all"].element_size() + a["page_table_1"].numel() * (8 + per_token)
    if not state.admit(estimate):
        return None
    tensors = dsa_tensors(a, out)
    meta = dsa_meta(layer, a["kv_cache"], a["page_table_1"], _kv_scale(layer, a["kv_cache"]))
    meta.update(layer_id=max(layer_id, 0), tp_rank=rank, step=step, sglang_version=versions().get("sglang_version"))
    name = capture_name(mode="decode", rank=rank, layer=max(layer_id, 0), step=step, backend="dsa-aiter", pid=os.getpid())
    state.write(name, tensors, meta)


def wrap_forward_aiter(original: Callable, state_of: Callable[[], Optional[HookState]]) -> Callable:
    """The ``_forward_aiter`` wrapper: the original's result, then a capture that never raises."""
    sig = inspect.signature(original)

    def _forward_aiter(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        state = state_of()
        if state is None or not state.active:
            return result
        with guarded(state):
            bound = sig.bind(self, *args, **kwargs)
            capture_dsa(state, {n: bound.arguments.get(n) for n in ARGS}, result)
        return result

    _forward_aiter.__wrapped__ = original  # type: ignore[attr-defined]
    return _forward_aiter


__all__ = ["capture_dsa", "dsa_meta", "dsa_tensors", "wrap_forward_aiter"]
