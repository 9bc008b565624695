"""(torch) DeepSeek-V4's C4 indexer on a decode call: SGLang's ``C4IndexerBackendMixin.forward_c4_indexer``
as an indexer capture (meta ``mode`` ``indexer``, ``compress_ratio`` 4, refmla.indexer), written
next to the V4 sparse decode capture of the same layer and step.

``forward_c4_indexer`` returns nothing and keeps its inputs in locals: the index query and weights
come from ``self._forward_prepare_normal`` / ``self._forward_prepare_multi_stream`` (methods of the
same mixin), the logits kernel and the top-k run in nested closures, and the result is written in
place into ``forward_metadata.core_metadata.c4_sparse_page_indices``. So three methods are wrapped,
none of the closures: while a wanted call runs, the prepare wrapper keeps a reference to what the
prepare step returned (q fp8 [rows, H, D], weights [rows, H, 1]); after the original returns, the
outer wrapper reads the metadata it filled (``indexer_metadata.page_table``, ``compressed_seq_lens``,
``compressed_page_size``, ``compress_ratio``; the indices written in place) and the layer's index-K
buffer (``token_to_kv_pool.get_index_k_with_scale_buffer``: DeepGEMM's paged fp8 layout), all as
SGLang left them. The capture's ``seq_lens`` are ``compressed_seq_lens x compress_ratio`` (the bound
the indexer was given; meta ``seq_lens_from`` says so).

Never into the server: the originals run first with their own arguments and their results are
returned untouched; an exception of the original propagates as it would without the hook (the
reference kept is dropped); the capture runs after, under the same filters and budget as every
capture. A call the format cannot describe (the fp4 indexer, several query rows per request,
SGLang's external-indices debug mode, a prepare step not seen) is a counted skip; any other
exception disables the hook once, logged, never raised.
"""

from __future__ import annotations

import inspect
import os
from typing import Any, Callable, Optional

import torch

from refmla.hook.call import Skip, guarded
from refmla.hook.filters import after_call_filters
from refmla.hook.indexer_call import indexer_tensors
from refmla.hook.runtime import versions
from refmla.hook.writer import HookState, capture_name

ARGS = ("self", "c4_indexer", "forward_batch")  # forward_c4_indexer's parameters the capture reads
_PREPARED: dict[int, Optional[tuple]] = {}  # id(backend) -> what its prepare step returned, while a wanted call runs


def wrap_prepare(original: Callable, state_of: Callable[[], Optional[HookState]]) -> Callable:
    """``_forward_prepare_normal`` / ``_multi_stream``: the original's result, kept (a reference, no
    copy) only while the outer wrapper of the same backend is waiting for it."""

    def prepare(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        if id(self) in _PREPARED:
            _PREPARED[id(self)] = result
        return result

    prepare.__wrapped__ = original  # type: ignore[attr-defined]
    return prepare


def wrap_forward_c4_indexer(original: Callable, state_of: Callable[[], Optional[HookState]]) -> Callable:
    """The ``forward_c4_indexer`` wrapper: the original, then a capture that never raises."""
    sig = inspect.signature(original)

    def forward_c4_indexer(self, *args, **kwargs):
        state = state_of()
        armed = state is not None and state.active
        if armed:
            _PREPARED[id(self)] = None
        try:
            result = original(self, *args, **kwargs)
        finally:
            prepared = _PREPARED.pop(id(self), None) if armed else None
        if not armed:
            return result
        with guarded(state):
            bound = sig.bind(self, *args, **kwargs)
            capture_c4_indexer(state, {n: bound.arguments.get(n) for n in ARGS}, prepared)
        return result

    forward_c4_indexer.__wrapped__ = original  # type: ignore[attr-defined]
    return forward_c4_indexer


def capture_c4_indexer(state: HookState, a: dict, prepared: Optional[tuple]) -> None:
    """Filters, budget, host copy, write: one C4 indexer capture (or a counted skip)."""
    owner, c4 = a["self"], a["c4_indexer"]
    layer_id = int(getattr(c4, "layer_id", -1))
    if getattr(a["forward_batch"], "forward_mode", None) is not None and a["forward_batch"].forward_mode.is_idle():
        return
    wanted = after_call_filters(state, "indexer", layer_id)
    if wanted is None:
        return
    rank, step = wanted
    if getattr(c4, "use_fp4_indexer", False):
        raise Skip("the fp4 C4 indexer (the format holds fp8 or bf16 keys)")
    if getattr(owner, "debug_use_external_c4_sparse_indices", False):
        raise Skip("SGLang's external C4 indices debug mode: the call chose none")
    if not isinstance(prepared, tuple) or len(prepared) != 2 or not torch.is_tensor(prepared[0]):
        raise Skip("the C4 indexer's query and weights were not seen (no prepare step of this SGLang ran)")
    q, w = prepared
    md = owner.forward_metadata
    im, cm = md.indexer_metadata, md.core_metadata
    if int(getattr(im, "rows_per_request", 1)) != 1:
        raise Skip("several query rows per request (MTP) in the C4 indexer")
    lens = im.compressed_seq_lens  # [B] entries each request's indexer scored
    B = lens.shape[0]
    indices = cm.c4_sparse_page_indices[:B]  # [B, K] compressed-cache slots, written in place
    kv = owner.token_to_kv_pool.get_index_k_with_scale_buffer(layer_id=layer_id)
    page = int(im.compressed_page_size)
    if page != 64 or kv.dim() != 2 or kv.shape[1] < page * 132 or q.dim() != 3 or q.shape[2] != 128 or q.element_size() != 1:
        raise Skip(f"a C4 indexer call of another layout (index-K {list(kv.shape)}, q {list(q.shape)} {q.dtype})")
    estimate = im.page_table.shape[0] * im.page_table.shape[1] * kv.shape[1] + q.numel() * 2
    if not state.admit(estimate):
        return
    weights = w.squeeze(-1) if w.dim() == 3 else w
    tensors = indexer_tensors(kv, im.page_table[:B], lens, q, weights, indices)  # Skip: q rows other than B
    ratio = int(getattr(im, "compress_ratio", 4))
    tensors["seq_lens"] = (tensors["seq_lens"].long() * ratio).int()  # tokens: the bound the indexer was given, times the ratio
    meta = {"mode": "indexer", "page_size": page, "topk": int(indices.shape[1]), "compress_ratio": ratio,
            "indices_kind": "slots", "k_layout": "fp8", "engine": "sglang", "layer_id": max(layer_id, 0),
            "tp_rank": rank, "step": step, "engine_version": versions().get("sglang_version"),
            "seq_lens_from": "compressed_seq_lens x compress_ratio"}  # fmt: skip
    rids = getattr(a["forward_batch"], "rids", None)
    if rids is not None and len(rids) >= B:
        meta["rids"] = [str(r) for r in list(rids)[:B]]
    from refmla.indexer.io import write_indexer

    name = capture_name(mode="indexer", rank=rank, layer=max(layer_id, 0), step=step, backend="sglang", pid=os.getpid())
    state.note_written(write_indexer(os.path.join(state.cfg.out_dir, name), tensors, {k: v for k, v in meta.items() if v is not None}))


__all__ = ["capture_c4_indexer", "wrap_forward_c4_indexer", "wrap_prepare"]
