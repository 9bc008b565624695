"""(torch) DeepSeek's sparse MLA decode calls captured from SGLang 0.5.23's HIP radix backend.

SGLang's ``DeepseekV4HipRadixBackend._forward_attention`` calls
``flash_mla_with_kvcache_entrypoint(backend=..., q=, k_cache=, indices=, topk_length=, attn_sink=,
extra_k_cache=, extra_indices_in_kvcache=, extra_topk_length=, softmax_scale=, head_dim_v=, ...,
[inv_rope=])``: those keyword arguments are the capture (docs/contract.md, "sparse decode
captures"), with the backend SGLang resolved (``resolve_hip_flashmla_backend``) in meta, and the
layer's compress ratio from the caller's ``compress_ratio`` (with the model's per-layer list). The
caches are saved as their padded page rows, only the pages the indices reference (renumbered).

:func:`wrap_entrypoint` returns the wrapper the patcher installs: the original runs first and its
result is returned untouched; the capture then reads (never writes) the tensors, under the same
filters and budgets as the dense hook (layer, rank, every N-th call, graph capture, folder budget),
and any exception inside it disables the hook once, logged (never raised into the server).

With the KV map (refmla.hook.sparse_kv: a decode call, or an extend on a prefill node restricted to
each request's last row) the capture also keeps every page the map names, the map renumbered to the
kept pages, ``k_cache_pages`` / ``extra_k_cache_pages`` the production page of each kept one, and
meta ``rids``: what diff-kv and disagg compare position by position.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from refmla.hook.geometry import disagg_meta, pool_counts, registered_regions
from refmla.hook.filters import after_call_filters
from refmla.hook.runtime import versions
from refmla.hook.sparse_kv import kv_map, last_rows
from refmla.hook.tensors import row_tokens
from refmla.hook.writer import HookState, capture_name
from refmla.sparse.validation import write_sparse
from refmla.sparse.layouts import LAYOUTS

LAYOUT_OF_BYTES = {L.bytes_per_token: name for name, L in LAYOUTS.items()}


def _pages(cache: torch.Tensor) -> torch.Tensor:
    """The [P, page_size, 1, bytes] view SGLang passes -> its padded page rows [P, stride(0)] uint8."""
    c = cache.view(torch.uint8) if cache.dtype != torch.uint8 else cache
    return torch.as_strided(c, (c.shape[0], c.stride(0)), (c.stride(0), 1), c.storage_offset())


def _compact(cache: torch.Tensor, idx: torch.Tensor, page: int,
             slots: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], torch.Tensor]:  # fmt: skip
    """Only the pages ``idx`` (and the KV map's ``slots``) reference (-1 kept), both renumbered to
    them; and the kept pages' production numbers."""
    rows = _pages(cache)
    parts = [idx.long().flatten()] + ([slots.long().to(idx.device)] if slots is not None else [])
    flat = torch.cat(parts)
    valid = flat >= 0
    used = torch.unique(torch.where(valid, flat // page, 0))
    new_page = torch.searchsorted(used, torch.where(valid, flat // page, 0))
    renum = torch.where(valid, new_page * page + flat % page, -1).to(torch.int32).cpu()
    n = idx.numel()
    return (rows.index_select(0, used).cpu(), renum[:n].reshape(idx.shape),
            renum[n:] if slots is not None else None, used.cpu())  # fmt: skip


def _cache_meta(cache: torch.Tensor) -> tuple[str, int]:
    bpt = int(cache.shape[-1])
    if bpt not in LAYOUT_OF_BYTES:
        raise ValueError(f"a cache of {bpt} bytes per token is no layout refmla reads")
    return LAYOUT_OF_BYTES[bpt], int(cache.shape[1])


def sparse_tensors(kw: dict, result: Any, kvm: Optional[dict] = None) -> tuple[dict, dict]:
    """(tensors, meta) of one entrypoint call: its keyword arguments and its (out, lse); with the KV
    map ``kvm`` (refmla.hook.sparse_kv) its tensors too."""
    layout, page = _cache_meta(kw["k_cache"])
    slots = _flat(kvm, "slots")
    k_cache, indices, mapped, pages = _compact(kw["k_cache"], kw["indices"], page, slots)
    t = {"q": kw["q"].detach().cpu(), "k_cache": k_cache, "indices": indices}
    if kvm is not None:
        t.update(seq_lens=kvm["seq_lens"], slot_indptr=_indptr(kvm["slots"]), slots=mapped, k_cache_pages=pages)
    meta = {"mode": "sparse_decode", "kv_layout": layout, "page_size": page,
            "softmax_scale": float(kw["softmax_scale"]), "head_dim_v": int(kw["head_dim_v"])}  # fmt: skip
    for key, name in (("topk_length", "topk_length"), ("attn_sink", "attn_sink"), ("extra_topk_length", "extra_topk_length")):
        if kw.get(key) is not None:
            t[name] = kw[key].detach().cpu()
    if kw.get("extra_k_cache") is not None:
        meta["extra_kv_layout"], meta["extra_page_size"] = _cache_meta(kw["extra_k_cache"])
        extra = _flat(kvm, "extra_slots")
        t["extra_k_cache"], t["extra_indices"], mapped, pages = _compact(
            kw["extra_k_cache"], kw["extra_indices_in_kvcache"], meta["extra_page_size"], extra)
        if extra is not None:
            t.update(extra_slot_indptr=_indptr(kvm["extra_slots"]), extra_slots=mapped, extra_k_cache_pages=pages)
    if kw.get("inv_rope") is not None:
        freqs, positions = kw["inv_rope"]
        t["inv_rope_freqs"], t["inv_rope_positions"] = freqs.detach().cpu(), positions.detach().cpu().reshape(-1)
    out, lse = (result if isinstance(result, tuple) else (result, None))[:2]
    if out is not None:
        t["out"] = out.detach().cpu()
    if lse is not None and lse.dim() == 3:
        t["lse"] = lse.detach().cpu().float()
    return t, meta


def _flat(kvm: Optional[dict], key: str) -> Optional[torch.Tensor]:
    per = None if kvm is None else kvm.get(key)
    return None if per is None else (torch.cat(per) if per else torch.zeros(0, dtype=torch.long))


def _indptr(per: list) -> torch.Tensor:
    ptr = torch.zeros(len(per) + 1, dtype=torch.int32)
    ptr[1:] = torch.cumsum(torch.tensor([int(x.numel()) for x in per], dtype=torch.int64), 0)
    return ptr


def _caller_local(name: str) -> Optional[Any]:
    """A local of the backend method that called the entrypoint (``layer``, ``token_to_kv_pool``:
    _forward_attention has both), by a frame look-up a few frames up; None when absent."""
    frame = sys._getframe(2)
    for _ in range(4):
        if frame is None:
            return None
        value = frame.f_locals.get(name)
        if value is not None:
            return value
        frame = frame.f_back
    return None


def pool_meta() -> dict:
    """The pool's registered regions (the MR region check) and the disaggregation settings."""
    pool = _caller_local("token_to_kv_pool")
    geometry = {**registered_regions(pool), **pool_counts(pool)} if pool is not None else {}
    return {**geometry, **disagg_meta()}


def ratio_meta(layer_id: int) -> dict:
    """The layer's compress ratio as the call was made with it (``_forward_attention``'s
    ``compress_ratio``: 0 window only, 4 C4, 128 C128, 1, 2), its role, and the model's per-layer
    list the pool was built from (``DeepSeekV4TokenToKVPool.compression_ratios``) when it agrees
    with the call at this layer; when it does not, the disagreement itself is recorded."""
    ratio = _caller_local("compress_ratio")
    if isinstance(ratio, bool) or not isinstance(ratio, int):
        return {}
    meta: dict = {"compress_ratio": int(ratio), "layer_role": "compressed" if ratio > 0 else "window"}
    pool = _caller_local("token_to_kv_pool")
    ratios = getattr(pool, "compression_ratios", None) if pool is not None else None
    try:
        ratios = [int(r) for r in ratios] if ratios is not None else None
    except (TypeError, ValueError):
        ratios = None
    if ratios and 0 <= layer_id < len(ratios):
        if ratios[layer_id] == ratio:
            meta["compress_ratios"] = ratios
        else:
            meta["compress_ratios_mismatch"] = f"pool compression_ratios[{layer_id}] = {ratios[layer_id]}, the call's {ratio}"
    return meta


def capture_call(state: HookState, kw: dict, result: Any, backend: str) -> None:
    """Filters, budget, host copy, write: one sparse capture (or a counted skip)."""
    layer = _caller_local("layer")
    layer_id = int(getattr(layer, "layer_id", -1))
    wanted = after_call_filters(state, "dsv4", layer_id)
    if wanted is None:
        return None
    rank, step = wanted
    estimate = sum(int(v.numel() * v.element_size()) for v in kw.values() if isinstance(v, torch.Tensor))
    if not state.admit(estimate):
        return None
    pool = pool_meta()
    ratio = ratio_meta(layer_id)
    kw, result, kvm = _with_kv_map(kw, result, pool.get("disagg_mode"), ratio.get("compress_ratio"))
    tensors, meta = sparse_tensors(kw, result, kvm)
    meta.update(pool)
    meta.update(ratio)
    if kvm is not None and "rids" in kvm:
        meta["rids"] = kvm["rids"]
        if "seq_lens" in tensors:  # each position's token id and origin, like slots (refmla.hook.requests)
            tensors.update(row_tokens(kvm["rids"], tensors["seq_lens"]))
    meta.update(backend=backend, layer_id=max(layer_id, 0), tp_rank=rank, step=step,
                sglang_version=versions().get("sglang_version"), capture_tool="refmla.hook.sparse_call")  # fmt: skip
    name = capture_name(mode="sparse", rank=rank, layer=max(layer_id, 0), step=step, backend=backend, pid=os.getpid())
    path = Path(state.cfg.out_dir) / name
    write_sparse(path, tensors, meta)
    state.note_written(path)


def _with_kv_map(kw: dict, result: Any, disagg_mode: Optional[str], ratio: Optional[int]) -> tuple[dict, Any, Optional[dict]]:
    """The call (restricted to each request's last row on a prefill node) and its KV map, when one can
    be read (refmla.hook.sparse_kv); else the call as it was and None."""
    fb, pool = _caller_local("forward_batch"), _caller_local("token_to_kv_pool")
    if fb is None or pool is None:
        return kw, result, None
    mode = getattr(fb, "forward_mode", None)
    try:
        decode = bool(mode.is_decode()) and int(kw["q"].shape[0]) == int(fb.batch_size)
        prefill = disagg_mode == "prefill" and bool(mode.is_extend())
    except Exception:
        return kw, result, None
    if prefill:
        picked = last_rows(kw, result, fb)
        if picked is None:
            return kw, result, None
        kw, result = picked
    elif not decode:
        return kw, result, None
    return kw, result, kv_map(kw, fb, pool, ratio)


def wrap_entrypoint(original: Callable, state_of: Callable[[], Optional[HookState]],
                    resolve: Callable[[Optional[str]], str]) -> Callable:  # fmt: skip
    """The entrypoint wrapper: the original's result, then a capture that never raises."""

    def entrypoint(backend: str, **kwargs):
        result = original(backend=backend, **kwargs)
        state = state_of()
        if state is None or not state.active:
            return result
        try:
            capture_call(state, kwargs, result, resolve(backend))
        except Exception as e:  # the hook never raises into the server
            state.fail(e)
        return result

    entrypoint.__wrapped__ = original  # type: ignore[attr-defined]
    return entrypoint


__all__ = ["capture_call", "sparse_tensors", "wrap_entrypoint"]
