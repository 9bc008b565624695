"""(torch) The KV map of a DeepSeek-V4 sparse call (docs/contract.md, "the KV map"): which token of
each cache holds each position of each request, read (never written) from SGLang 0.5.23's own state,
as ``_forward_attention`` has it in its locals (``forward_batch``, ``token_to_kv_pool``, ``compress_ratio``):

    seq_lens     ``forward_batch.seq_lens`` (the tokens each request's KV has)
    window cache ``token_to_kv_pool.full_to_swa_index_mapping[req_to_token[req, :seq_len]]`` from the
                 window's first page on (max(0, seq_len - sliding_window) rounded down to the window
                 cache's page: what the pool keeps and a PD transfer sends), -1 before it
    compressed   C4 / C128 entry i is slot ``req_to_token[req, i * ratio] // ratio`` of the compressed
                 cache (the pool's "slot = full-pool loc // ratio"), seq_len // ratio entries

It is recorded when each query row is one request (decode), or on a prefill node (meta ``disagg_mode``
``prefill``) where the call is an extend: there the capture keeps each request's last query row only
(:func:`last_rows`). Anything it does not recognize (a request-window or unified pool, a ratio 1 / 2
layer, a missing attribute) gives no map, never an error: the hook never raises into the server.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

ROW_KWARGS = ("q", "indices", "topk_length", "extra_indices_in_kvcache", "extra_topk_length")


def _int(v: Any) -> Optional[int]:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def kv_map(kw: dict, forward_batch: Any, pool: Any, ratio: Optional[int]) -> Optional[dict]:
    """{"rids", "seq_lens", "slots" [per request, physical window-cache tokens, -1 not held], and with a
    C4 / C128 cache "extra_slots"}, or None when SGLang's state is not what this reads."""
    try:
        r2t = forward_batch.req_to_token_pool.req_to_token
        bs = int(forward_batch.batch_size)
        rpi = forward_batch.req_pool_indices[:bs].long()
        lens = forward_batch.seq_lens[:bs].long().cpu()
        mapping = getattr(pool, "full_to_swa_index_mapping", None)
        window, page = _int(getattr(pool, "sliding_window", None)), int(kw["k_cache"].shape[1])
    except Exception:
        return None
    if mapping is None or window is None or getattr(pool, "request_window", None) is not None:
        return None
    out: dict = {"seq_lens": lens.to(torch.int32), "slots": [], "extra_slots": [] if ratio in (4, 128) else None}
    for b in range(bs):
        L = int(lens[b])
        full = r2t[rpi[b], :L].long()
        j = torch.arange(L, device=full.device)
        start = max(0, L - window) // page * page
        out["slots"].append(torch.where(j >= start, mapping[full].long(), -1).cpu())
        if out["extra_slots"] is not None:
            out["extra_slots"].append((full[:: ratio][: L // ratio] // ratio).cpu())
    rids = getattr(forward_batch, "rids", None)
    if rids is not None and len(rids) >= bs:
        out["rids"] = [str(r) for r in list(rids)[:bs]]
    return out


def last_rows(kw: dict, result: Any, forward_batch: Any) -> Optional[tuple[dict, Any]]:
    """An extend call restricted to each request's last query row (its keyword arguments and result),
    or None when its rows are not the batch's extend tokens in order."""
    try:
        ext = forward_batch.extend_seq_lens[: int(forward_batch.batch_size)].long()
        rows = (torch.cumsum(ext, 0) - 1).to(kw["q"].device)
        if int(ext.sum()) != int(kw["q"].shape[0]):
            return None
    except Exception:
        return None
    picked = {k: (v.index_select(0, rows) if k in ROW_KWARGS and isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    if kw.get("inv_rope") is not None:
        freqs, positions = kw["inv_rope"]
        picked["inv_rope"] = (freqs, positions.reshape(-1).index_select(0, rows))
    res = result if isinstance(result, tuple) else (result,)
    res = tuple(r.index_select(0, rows) if isinstance(r, torch.Tensor) and r.shape[:1] == kw["q"].shape[:1] else r
                for r in res)  # fmt: skip
    return picked, res if isinstance(result, tuple) else res[0]


__all__ = ["kv_map", "last_rows"]
