"""Writing a capture: compact the pool, validate, write atomically, sort the header.

A file on disk is always a readable capture: the tensors and meta are validated before anything
is written, and the file appears under its name only once complete (refmla.atomic).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

import torch

from refmla import CAPTURE_FORMAT, blocktable
from refmla.atomic import write_bytes
from refmla.capture.format import TENSORS, Capture, CaptureError, parse_meta
from refmla.capture.validation import validate

# --------------------------------------------------------------------------------------------
# Compaction
# --------------------------------------------------------------------------------------------


def compact_pool(tensors: dict[str, torch.Tensor], page_size: int = 1) -> dict[str, torch.Tensor]:
    """Keep only the pool rows that kv_indices (and req_to_token up to each seq_len) reference.

    kv_indices and req_to_token are remapped to the compacted numbering; req_to_token entries
    past a request's seq_len become -1; orig_kv_indices keeps the physical slots. A capture with
    a block_table keeps whole pages instead (:func:`compact_block_table`).
    """
    if tensors.get("block_table") is not None:
        return compact_block_table(tensors, page_size)
    t = dict(tensors)
    idx = t["kv_indices"].long()
    seq = t["seq_lens"].long()
    r2t = t.get("req_to_token")
    used = [idx]
    if r2t is not None:
        valid = torch.arange(r2t.shape[1])[None, :] < seq[:, None]  # [B, M]
        used.append(r2t.long()[valid & (r2t >= 0) & (r2t < t["kv_buffer"].shape[0])])
    rows = torch.unique(torch.cat(used))  # sorted physical slots
    orig = t.get("orig_kv_indices")
    t["orig_kv_indices"] = (orig.long() if orig is not None else idx).clone()
    t["kv_buffer"] = t["kv_buffer"].index_select(0, rows.to(t["kv_buffer"].device))
    t["kv_indices"] = torch.searchsorted(rows, idx).to(t["kv_indices"].dtype)
    if r2t is not None:
        t["req_to_token"] = _remap_req_to_token(r2t, seq, rows)
    return t


def compact_block_table(tensors: dict[str, torch.Tensor], page_size: int) -> dict[str, torch.Tensor]:
    """Keep the pages the block table names (refmla.blocktable.compact_pages), renumber the table,
    and store kv_indptr / kv_indices of the compacted pool; orig_kv_indices keeps the physical slots.
    The table must be consistent (write_capture checks it first)."""
    t = dict(tensors)
    P, pool = int(page_size), t["kv_buffer"]
    table, seq = t["block_table"], t["seq_lens"]
    _, physical = blocktable.token_rows(table, seq, P)
    kept, renumbered = blocktable.compact_pages(table, P, pool.shape[0])
    paged = pool[: (pool.shape[0] // P) * P].unflatten(0, (-1, P))  # [pages, P, 1, D]
    t["kv_buffer"] = paged.index_select(0, kept.to(pool.device)).flatten(0, 1)  # [K * P, 1, D]
    t["block_table"] = renumbered
    t["kv_indptr"], t["kv_indices"] = blocktable.token_rows(renumbered, seq, P)
    orig = t.get("orig_kv_indices")
    t["orig_kv_indices"] = (orig.long() if orig is not None else physical).clone()
    return t


def _remap_req_to_token(r2t: torch.Tensor, seq: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """req_to_token [B, M] in physical slots -> [B, max(seq)] in compacted rows, -1 where not kept."""
    M = int(seq.max()) if seq.numel() else 0
    slots = r2t[:, :M].long()
    pos = torch.searchsorted(rows, slots.clamp(min=0)).clamp(max=max(len(rows) - 1, 0))
    hit = (rows[pos] == slots) if len(rows) else torch.zeros_like(slots, dtype=torch.bool)
    keep = hit & (torch.arange(M)[None, :] < seq[:, None])
    return torch.where(keep, pos, -1).to(r2t.dtype)


# --------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------


def write_capture(
    path: Any,
    tensors: Mapping[str, torch.Tensor],
    meta: Mapping[str, Any],
    *,
    compact: bool = True,
    validate_first: bool = True,
) -> Path:
    """Write a capture atomically (temp file in the same folder, then rename).

    ``tensors`` and ``meta`` follow docs/contract.md section 1. With ``compact``, the pool is
    reduced to the referenced rows (see :func:`compact_pool`). The result is validated before
    anything is written, so a file on disk is always a readable capture.
    """
    path = Path(path)
    unknown = set(tensors) - set(TENSORS)
    if unknown:
        raise CaptureError(path, f"tensor '{sorted(unknown)[0]}'", "not part of refmla.capture/1")
    t = {k: v.detach().to("cpu") for k, v in tensors.items() if v is not None}
    parsed = parse_meta(dict(meta), path)
    if t.get("block_table") is not None:
        _check_block_table(path, t, parsed.page_size)
    if compact:
        t = compact_pool(t, parsed.page_size)
    if validate_first:
        validate(Capture(path=str(path), meta=parsed, **t))
    header = {"format": CAPTURE_FORMAT, "meta": json.dumps(parsed.to_json(), sort_keys=True)}
    _write_atomic(path, {k: v.contiguous() for k, v in t.items()}, header)
    return path


def _check_block_table(path: Path, t: dict[str, torch.Tensor], page_size: int) -> None:
    """Every inconsistency of the block table, one line each (CaptureError); kv_indptr /
    kv_indices built from it when not given."""
    found = blocktable.problems(t["block_table"], t["seq_lens"], page_size, t["kv_buffer"].shape[0])
    if found.errors:
        raise CaptureError(path, "tensor 'block_table'", found.text(found.errors))
    if "kv_indptr" not in t or "kv_indices" not in t:
        t["kv_indptr"], t["kv_indices"] = blocktable.token_rows(t["block_table"], t["seq_lens"], page_size)


def _write_atomic(path: Path, tensors: dict[str, torch.Tensor], header: dict[str, str]) -> None:
    """The safetensors bytes, header metadata sorted, written by :func:`refmla.atomic.write_bytes`."""
    from safetensors.torch import save

    write_bytes(path, sorted_header(save(unshared(tensors), metadata=header)), make_parents=True)


def unshared(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors with any that shares memory with one before it copied: safetensors refuses shared
    tensors, and a writer may hand the same tensor twice (rows before and after a call that wrote
    nothing)."""
    seen: set = set()
    out = {}
    for k, v in tensors.items():
        key = (v.untyped_storage().data_ptr(), v.device.type) if v.numel() else None
        out[k] = v.clone() if key in seen else v
        if key is not None:
            seen.add(key)
    return out


def sorted_header(data: bytes) -> list:
    """The same safetensors bytes (as chunks, without copying the tensors) with the ``__metadata__``
    keys sorted (same length, same meaning), so the same capture is the same bytes: safetensors
    writes them from a hash map, in any order."""
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    header["__metadata__"] = dict(sorted(header.get("__metadata__", {}).items()))
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    if len(text) > n:  # a reordering of the same keys never grows; keep the bytes if it would
        return [data]
    return [data[:8], text + b" " * (n - len(text)), memoryview(data)[8 + n :]]


__all__ = ["unshared", "compact_block_table", "compact_pool", "write_capture"]
