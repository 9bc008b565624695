"""(torch) DeepSeek-V3.2's lightning indexer on a decode call: SGLang's ``Indexer._get_topk_paged``
as an indexer capture (meta ``mode`` ``indexer``, refmla.indexer), written next to the sparse decode
capture of the same layer and step (file ``indexer-tp{rank}-L{layer}-s{step}-sglang-p{pid}``).

What the call got: ``q_fp8`` [B, H, D] (one query token per request), ``weights`` [B, H] (q's scale,
the softmax scale and H**-0.5 folded in), and what it reads from SGLang's pool and metadata: the
layer's index-K buffer (``self._get_index_k_read_buffer(pool, layer_id)``, pages of 64 entries:
64 x 128 fp8, then 64 fp32 scales), ``metadata.get_page_table_64()`` and
``metadata.get_seqlens_int32()``; what it returned: the top-k as pool slots (page << 6 | offset,
-1 invalid). The capture keeps the pages the requests' entries fill (``k_cache_pages``: their
production numbers) and the page table renumbered to them.

:func:`wrap_get_topk_paged` returns the method the patcher installs: the original runs first and its
result is returned untouched; the capture only reads, under the same filters and budgets as every
hook capture; a call the format cannot describe (several query tokens per request) is a counted
skip, and any other exception disables the hook once, logged, never raised into the server.
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

ARGS = ("self", "forward_batch", "layer_id", "q_fp8", "weights", "metadata")  # _get_topk_paged's parameters
PAGE = 64


def indexer_tensors(kv: torch.Tensor, table: torch.Tensor, seqlens: torch.Tensor, q_fp8: torch.Tensor,
                    weights: torch.Tensor, topk: torch.Tensor) -> dict[str, torch.Tensor]:  # fmt: skip
    """Host copies of one decode call: the pages its requests' entries fill, renumbered."""
    B = seqlens.shape[0]
    if q_fp8.dim() != 3 or q_fp8.shape[0] != B or topk.shape[0] != B or weights.shape[0] != B:
        raise Skip(f"indexer call with {q_fp8.shape[0]} query rows for {B} requests (several query tokens per request)")
    lens = seqlens.detach().to("cpu", torch.int64)
    need = (lens + PAGE - 1) // PAGE  # [B]
    tab = table.detach().to("cpu", torch.int64)[:, : max(1, int(need.max()) if B else 1)]
    cols = torch.arange(tab.shape[1])
    wanted = cols[None, :] < need[:, None]
    used, renum = torch.unique(tab[wanted], return_inverse=True)
    page_table = torch.full_like(tab, -1)
    page_table[wanted] = renum
    pages = kv.detach().reshape(kv.shape[0], -1)
    return {"q": q_fp8.detach().cpu(), "weights": weights.detach().float().cpu(),
            "k_cache": pages.index_select(0, used.to(pages.device)).cpu(), "page_table": page_table.int(),
            "seq_lens": lens.int(), "indices": topk.detach().cpu().int(), "k_cache_pages": used.int()}  # fmt: skip


def capture_indexer(state: HookState, a: dict, result: Any, pool_of: Callable[[], Any]) -> None:
    """Filters, budget, host copy, write: one indexer capture (or a counted skip); ``pool_of``:
    SGLang's ``get_token_to_kv_pool`` as the indexer's module sees it."""
    layer_id = int(a["layer_id"])
    wanted = after_call_filters(state, "indexer", layer_id)
    if wanted is None:
        return
    rank, step = wanted
    if not torch.is_tensor(result) or result.dim() != 2:
        raise Skip("indexer call without a [rows, topk] result")
    owner, meta_obj = a["self"], a["metadata"]
    kv = owner._get_index_k_read_buffer(pool_of(), layer_id)
    table, seqlens = meta_obj.get_page_table_64(), meta_obj.get_seqlens_int32()
    estimate = table.shape[0] * table.shape[1] * kv[0].numel() + a["q_fp8"].numel() * 2
    if not state.admit(estimate):
        return
    tensors = indexer_tensors(kv, table, seqlens, a["q_fp8"], a["weights"], result)
    meta = {"mode": "indexer", "page_size": PAGE, "topk": int(result.shape[1]), "compress_ratio": 1,
            "indices_kind": "slots", "k_layout": "fp8", "engine": "sglang", "layer_id": max(layer_id, 0),
            "tp_rank": rank, "step": step, "engine_version": versions().get("sglang_version")}  # fmt: skip
    rids = getattr(a["forward_batch"], "rids", None)
    if rids is not None and len(rids) >= seqlens.shape[0]:
        meta["rids"] = [str(r) for r in list(rids)[: seqlens.shape[0]]]
    from refmla.indexer.io import write_indexer

    name = capture_name(mode="indexer", rank=rank, layer=max(layer_id, 0), step=step, backend="sglang", pid=os.getpid())
    state.note_written(write_indexer(os.path.join(state.cfg.out_dir, name), tensors, {k: v for k, v in meta.items() if v is not None}))


def wrap_get_topk_paged(original: Callable, state_of: Callable[[], Optional[HookState]]) -> Callable:
    """The ``_get_topk_paged`` wrapper: the original's result, then a capture that never raises."""
    sig = inspect.signature(original)
    pool_of = original.__globals__.get("get_token_to_kv_pool")

    def _get_topk_paged(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        state = state_of()
        if state is None or not state.active:
            return result
        with guarded(state):
            bound = sig.bind(self, *args, **kwargs)
            if pool_of is None:
                raise Skip("the indexer's module has no get_token_to_kv_pool")
            capture_indexer(state, {n: bound.arguments.get(n) for n in ARGS}, result, pool_of)
        return result

    _get_topk_paged.__wrapped__ = original  # type: ignore[attr-defined]
    return _get_topk_paged


__all__ = ["capture_indexer", "indexer_tensors", "wrap_get_topk_paged"]
