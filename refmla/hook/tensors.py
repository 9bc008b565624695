"""Host copies of what the kernel read: pool rows gathered, slots renumbered, unwritten splits blanked.

The torch side of the hook (imported on the first captured call, never at start-up).
"""

from __future__ import annotations

import torch

from refmla.hook.requests import TABLE, RequestTable, rows_of
from refmla.hook.sglang_paths import DECODE_KERNEL_MODULES, loaded_module
from refmla.schedule import nonempty_splits_batch


def gather_rows(buf: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``buf[rows]`` for a pool view of any dtype (fp8 gathered through its uint8 bytes)."""
    rows = rows.to(buf.device)
    if buf.element_size() == 1 and buf.dtype not in (torch.uint8, torch.int8):
        return buf.view(torch.uint8).index_select(0, rows).view(buf.dtype)
    return buf.index_select(0, rows)


def referenced_rows(kv_indices: torch.Tensor, req_to_token, seq_lens: torch.Tensor, N: int) -> torch.Tensor:
    """Sorted physical slots the capture keeps: every kv_index and every live in-range req_to_token slot."""
    used = [kv_indices]
    if req_to_token is not None:
        live = torch.arange(req_to_token.shape[1])[None, :] < seq_lens[:, None]  # [B, M]
        used.append(req_to_token.long()[live & (req_to_token >= 0) & (req_to_token < N)])
    return torch.unique(torch.cat(used))


def remap_req_to_token(req_to_token: torch.Tensor, rows: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
    """req_to_token [B, M] in the compacted numbering of kv_indices; past a request's seq_len: -1."""
    r2t = req_to_token.long()  # [B, M] physical slots
    pos = torch.searchsorted(rows, r2t.clamp(min=0)).clamp(max=max(rows.numel() - 1, 0))  # [B, M]
    hit = rows[pos] == r2t if rows.numel() else torch.zeros_like(r2t, dtype=torch.bool)
    keep = hit & (torch.arange(r2t.shape[1])[None, :] < seq_lens[:, None])
    return torch.where(keep, pos, -1).to(req_to_token.dtype)


def blank_empty_splits(attn_logits: torch.Tensor, attn_lse: torch.Tensor, seq_lens, num_kv_splits) -> None:
    """NaN in the (host copy of the) splits stage 1 never wrote: their bytes are leftovers."""
    kernel = loaded_module(DECODE_KERNEL_MODULES)
    filled = nonempty_splits_batch(seq_lens, num_kv_splits, int(getattr(kernel, "_MIN_BLOCK_KV", 32)))  # [B]
    S = attn_logits.shape[2]
    empty = filled[:, None] <= torch.arange(S)[None, :]  # [B, S]
    attn_logits[empty[:, None, :, None].expand_as(attn_logits)] = float("nan")
    attn_lse[empty[:, None, :].expand_as(attn_lse)] = float("nan")


def row_tokens(rids, seq_lens: torch.Tensor, table: RequestTable = TABLE) -> dict[str, torch.Tensor]:
    """``kv_token_ids`` / ``kv_origin`` (refmla.capture.rows) of requests ``rids`` holding ``seq_lens``
    positions each, from what ForwardBatch.init_new saw (refmla.hook.requests); {} when no request is known."""
    if rids is None or len(rids) < seq_lens.numel():
        return {}
    known = [table.get(str(rid)) for rid in list(rids)[: seq_lens.numel()]]
    if all(k is None for k in known):
        return {}
    tokens, origin = [], []
    for rows, L in zip(known, seq_lens.tolist()):
        t, o = rows_of(rows, int(L))
        tokens += t
        origin += o
    return {"kv_token_ids": torch.tensor(tokens, dtype=torch.int64), "kv_origin": torch.tensor(origin, dtype=torch.int8)}
