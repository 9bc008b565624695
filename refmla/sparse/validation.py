"""Every inconsistency of a sparse capture, one line each (docs/contract.md section 1).

:func:`problems` returns them all as :class:`CaptureError` (file + tensor or key + reason);
:func:`validate` raises the first. Dtypes and shapes first, then what the contents must satisfy:
an index past its cache, a length past the index width, a cache whose bytes do not match its layout.

:func:`read_sparse` / :func:`write_sparse`: the file, validated before it is written (atomically) and
when it is read (lazily, with the same container helpers as every capture, refmla.capture).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping, Optional

import torch

from refmla import CAPTURE_FORMAT
from refmla.atomic import write_bytes
from refmla.capture import CaptureError
from refmla.capture.numbers import meta_json
from refmla.capture.read import open_capture, safetensors_open
from refmla.capture.write import sorted_header
from refmla.capture.rows import ROW_TENSORS, row_tensor_problem
from refmla.sparse.format import KV_MAP, TENSORS, SparseCapture, SparseMeta, is_sparse_meta, parse_sparse_meta
from refmla.sparse.layouts import PackedLayout
from refmla.results import Finding
from refmla.util import dtype_name, request_label

INDEX_DTYPES = (torch.int32, torch.int64)
# entries in one index list of a query row (K of indices, K2 of extra_indices), at most: V3.2 reads
# 2,048, V4 128 + 512; one row's keys in fp64 (both lists: 2 x 32,768 x 576 x 8 bytes = 302 MB) then
# fit the 2 GiB a replay may use (the reference's blocks are one row at least; issue 33)
MAX_TOPK = 1 << 15
def _ratio(cap: SparseCapture) -> list[tuple[str, str]]:
    """A compressed layer's call carries its compressed cache, a window-only layer's none (SGLang's
    _forward_attention passes extra_k_cache exactly when the layer's ratio is > 0)."""
    r = cap.meta.compress_ratio
    if r is None or cap.meta.kv_layout != "v4":
        return []
    if r > 0 and cap.extra_k_cache is None:
        return [("extra_k_cache", f"missing: meta compress_ratio {r} is a compressed layer (its call reads the compressed cache)")]
    if r == 0 and cap.extra_k_cache is not None:
        return [("extra_k_cache", "present, but meta compress_ratio 0 is a window-only layer")]
    return []


Q_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def validate(cap: SparseCapture) -> None:
    """Raise the first problem, if any."""
    found = problems(cap)
    if found:
        raise found[0]


def problems(cap: SparseCapture) -> list[CaptureError]:
    out: list[CaptureError] = []
    for check in (_q, _caches, _scopes, _ratio, _sink_out_lse, _inv_rope, _kv_map):
        out += [CaptureError(cap.path, f"tensor '{name}'", msg) for name, msg in check(cap)]
        if out and check in (_q, _caches):  # later checks read the shapes these establish
            break
    return out


def _q(cap: SparseCapture) -> list[tuple[str, str]]:
    q, L = cap.q, cap.meta.layout
    if q.dtype not in Q_DTYPES:
        return [("q", f"dtype {dtype_name(q.dtype)}, expected bf16, fp16 or fp32")]
    if q.dim() != 4 or q.shape[-1] != L.head_dim:
        return [("q", f"shape {list(q.shape)}, expected [B, S, H, {L.head_dim}] (layout {L.name})")]
    if cap.meta.head_dim_v > L.head_dim:
        return [("q", f"head_dim_v {cap.meta.head_dim_v} is wider than the layout's head_dim {L.head_dim}")]
    return []


def _cache(name: str, cache: Optional[torch.Tensor], L: Optional[PackedLayout], page: Optional[int]) -> list:
    if cache is None:
        return []
    if L is None or page is None:
        return [(name, "present but meta extra_kv_layout / extra_page_size is missing")]
    if cache.dtype != torch.uint8 or cache.dim() != 2:
        return [(name, f"{dtype_name(cache.dtype)} {list(cache.shape)}, expected uint8 [pages, page bytes]")]
    need = page * L.bytes_per_token
    if cache.shape[1] < need:
        return [(name, f"{cache.shape[1]} bytes per page, layout {L.name} needs {page} x {L.bytes_per_token} = "
                       f"{need} (a layout whose byte count does not match)")]  # fmt: skip
    return []


def _caches(cap: SparseCapture) -> list[tuple[str, str]]:
    m = cap.meta
    out = _cache("k_cache", cap.k_cache, m.layout, m.page_size)
    out += _cache("extra_k_cache", cap.extra_k_cache, m.extra_layout, m.extra_page_size)
    if cap.extra_k_cache is not None and m.extra_layout is not None and m.extra_layout.head_dim != m.layout.head_dim:
        out.append(("extra_k_cache", f"layout {m.extra_kv_layout} has head_dim {m.extra_layout.head_dim}, "
                                     f"the main cache {m.layout.head_dim}"))  # fmt: skip
    return out


def _scope(cap: SparseCapture, prefix: str, idx, lengths, tokens: int) -> list[tuple[str, str]]:
    B, S = cap.q.shape[:2]
    name = f"{prefix}indices"
    if idx.dtype not in INDEX_DTYPES or idx.dim() != 3 or tuple(idx.shape[:2]) != (B, S):
        return [(name, f"{dtype_name(idx.dtype)} {list(idx.shape)}, expected int32 [{B}, {S}, K]")]
    if idx.shape[2] > MAX_TOPK:
        return [(name, f"{idx.shape[2]:,} entries per query row: past the bound {MAX_TOPK:,} (docs/contract.md, Bounds)")]
    out = []
    low = idx < -1
    if bool(low.any()):
        b, s, k = (int(v) for v in low.nonzero()[0])
        out.append((name, f"[{b}, {s}, {k}] = {int(idx[b, s, k])}: below -1 (-1 is the only invalid marker)"))
    past = idx >= tokens
    if bool(past.any()):
        b, s, k = (int(v) for v in past.nonzero()[0])
        out.append((name, f"[{b}, {s}, {k}] = {int(idx[b, s, k])} points past the cache ({tokens} tokens); "
                          f"{int(past.sum())} entries do"))  # fmt: skip
    if lengths is not None:
        ln = f"{prefix}topk_length"
        if lengths.dtype not in INDEX_DTYPES or tuple(lengths.shape) != (B,):
            out.append((ln, f"{dtype_name(lengths.dtype)} {list(lengths.shape)}, expected int32 [{B}]"))
        elif bool(((lengths < 0) | (lengths > idx.shape[2])).any()):
            b = int(((lengths < 0) | (lengths > idx.shape[2])).nonzero()[0])
            out.append((ln, f"[{b}] = {int(lengths[b])} is past the index width {idx.shape[2]} (or negative)"))
    return out


def _scopes(cap: SparseCapture) -> list[tuple[str, str]]:
    out = _scope(cap, "", cap.indices, cap.topk_length, cap.cache_tokens())
    if (cap.extra_k_cache is None) != (cap.extra_indices is None):
        missing = "extra_indices" if cap.extra_indices is None else "extra_k_cache"
        out.append((missing, "missing: extra_k_cache and extra_indices come together"))
    elif cap.extra_indices is not None:
        out += _scope(cap, "extra_", cap.extra_indices, cap.extra_topk_length, cap.cache_tokens(extra=True))
    if cap.extra_topk_length is not None and cap.extra_indices is None:
        out.append(("extra_topk_length", "present without extra_indices"))
    return out


def _sink_out_lse(cap: SparseCapture) -> list[tuple[str, str]]:
    B, S, H, _ = cap.q.shape
    want = {"attn_sink": (H,), "out": (B, S, H, cap.meta.head_dim_v), "lse": (B, S, H),
            "golden_out": (B, S, H, cap.meta.head_dim_v), "golden_lse": (B, S, H)}
    out = []
    for name, shape in want.items():
        t = getattr(cap, name)
        if t is not None and (not t.dtype.is_floating_point or tuple(t.shape) != shape):
            out.append((name, f"{dtype_name(t.dtype)} {list(t.shape)}, expected a float {list(shape)}"))
    return out


def _inv_rope(cap: SparseCapture) -> list[tuple[str, str]]:
    f, p = cap.inv_rope_freqs, cap.inv_rope_positions
    if f is None and p is None:
        return []
    if f is None or p is None:
        return [("inv_rope_freqs" if f is None else "inv_rope_positions", "missing: the inverse rope needs both")]
    d_rope = cap.meta.layout.d_rope
    if f.dim() != 2 or f.shape[1] != d_rope or not f.dtype.is_floating_point:
        return [("inv_rope_freqs", f"{dtype_name(f.dtype)} {list(f.shape)}, expected a float [M, {d_rope}]")]
    if p.dtype not in INDEX_DTYPES or p.dim() != 1 or p.shape[0] < cap.rows:
        return [("inv_rope_positions", f"{dtype_name(p.dtype)} {list(p.shape)}, expected int [>= {cap.rows}]")]
    bad = (p[: cap.rows] < 0) | (p[: cap.rows] >= f.shape[0])
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        return [("inv_rope_positions", f"[{i}] = {int(p[i])} is outside the table ({f.shape[0]} positions)")]
    return []


def _kv_map(cap: SparseCapture) -> list[tuple[str, str]]:
    """The KV map (refmla.sparse.format): the lengths, each cache's token per position, its page map."""
    present = [n for n in ("seq_lens", *KV_MAP[""], *KV_MAP["extra_"]) if getattr(cap, n) is not None]
    if not present:
        rows = [n for n in ROW_TENSORS if getattr(cap, n) is not None]
        return [(rows[0], "present without the KV map (seq_lens, slot_indptr, slots)")] if rows else []
    B, L = cap.q.shape[0], cap.seq_lens
    if L is None:
        return [("seq_lens", f"missing: {present[0]} is part of the KV map, which needs the requests' lengths")]
    if L.dtype not in INDEX_DTYPES or tuple(L.shape) != (B,) or (L.numel() and int(L.min()) < 0):
        return [("seq_lens", f"{dtype_name(L.dtype)} {list(L.shape)}, expected int32 [{B}], each >= 0")]
    if cap.slots is None and cap.slot_indptr is None:
        return [("slots", "missing: seq_lens comes with slot_indptr and slots (the main cache's token per position)")]
    ratio = cap.meta.compress_ratio
    out = _cache_map(cap, "", cap.k_cache, cap.meta.page_size, L)
    for name in ROW_TENSORS:  # each position's token id and origin, like slots (refmla.capture.rows)
        t = getattr(cap, name)
        problem = row_tensor_problem(name, t, cap.slots.numel(), "slots") if t is not None and cap.slots is not None else None
        out += [(name, problem)] if problem else []
    if cap.extra_k_cache is None:
        out += [(n, "present without extra_k_cache") for n in KV_MAP["extra_"] if getattr(cap, n) is not None]
    elif cap.extra_slots is not None or cap.extra_slot_indptr is not None:
        want = L // ratio if ratio else None
        out += _cache_map(cap, "extra_", cap.extra_k_cache, cap.meta.extra_page_size, want if want is not None else L,
                          exact=want is not None)  # fmt: skip
    return out


def _cache_map(cap: SparseCapture, prefix: str, cache: torch.Tensor, page: int, counts: torch.Tensor,
               exact: bool = True) -> list[tuple[str, str]]:  # fmt: skip
    """One cache's part of the KV map: indptr [B + 1] from 0 with ``counts`` per request (at most, when
    not ``exact``), its tokens -1 or inside the cache, its page map one distinct page per captured page."""
    n_ptr, n_slots, n_pages = KV_MAP[prefix]
    ptr, slots, pages = (getattr(cap, n) for n in KV_MAP[prefix])
    B = counts.shape[0]
    if ptr is None or slots is None:
        return [(n_ptr if ptr is None else n_slots, f"missing: {n_ptr} and {n_slots} come together")]
    if ptr.dtype not in INDEX_DTYPES or tuple(ptr.shape) != (B + 1,) or int(ptr[0]) != 0 or int(ptr[-1]) != slots.numel():
        return [(n_ptr, f"{dtype_name(ptr.dtype)} {list(ptr.shape)}, expected int32 [{B + 1}] from 0 to len({n_slots})")]
    if slots.dtype not in INDEX_DTYPES or slots.dim() != 1:
        return [(n_slots, f"{dtype_name(slots.dtype)} {list(slots.shape)}, expected int32 [N]")]
    have = ptr[1:].long() - ptr[:-1].long()
    bad = (have != counts) if exact else (have < 0) | (have > counts)
    if bool(bad.any()):
        b = int(bad.nonzero()[0])
        need = f"{int(counts[b])}" if exact else f"0 .. {int(counts[b])}"
        what = "seq_lens" if not prefix else f"seq_lens // compress_ratio ({cap.meta.compress_ratio})"
        return [(n_ptr, f"request {b} has {int(have[b])} positions, {what} says {need}")]
    tokens = cache.shape[0] * page
    wrong = (slots < -1) | (slots >= tokens)
    if bool(wrong.any()):
        i = int(wrong.nonzero()[0])
        return [(n_slots, f"[{i}] = {int(slots[i])} is outside the cache ({tokens} tokens; -1: not held)")]
    if pages is None:
        return []
    if pages.dtype not in INDEX_DTYPES or tuple(pages.shape) != (cache.shape[0],) or (pages.numel() and int(pages.min()) < 0):
        return [(n_pages, f"{dtype_name(pages.dtype)} {list(pages.shape)}, expected int [{cache.shape[0]}] "
                          "(one per captured page), each >= 0")]  # fmt: skip
    if torch.unique(pages).numel() != pages.numel():
        return [(n_pages, "a production page listed twice (each captured page is one production page)")]
    return []


UPSTREAM = "the input is already non-finite: the fault is upstream of attention"


def nonfinite_inputs(cap: SparseCapture, ref_out: torch.Tensor, lonely: torch.Tensor) -> list[Finding]:
    """Requests whose q or attended cache bytes (fp8 values, UE8M0 / fp32 scales, rope) are NaN /
    Inf, or whose attn_sink is NaN (a sink of +inf or -inf is defined, FlashMLA's convention: the
    output scaled by 1 / (1 + exp(sink - lse)), 0 at +inf, unchanged at -inf): the q rows and the sink are looked at, the attended bytes through the fp64
    reference ``ref_out`` [B, S, H, Dv] (non-finite only from them). ``lonely`` [B * S]: rows
    that attend nothing (their output reads nothing). Agreeing NaN is not agreement."""
    B, S, H, _ = cap.q.shape
    live = ~lonely.reshape(B, S)  # [B, S]
    bad_q = (~torch.isfinite(cap.q.float()).all(dim=-1) & live[..., None]).any(dim=1)  # [B, H]
    sink_bad = cap.attn_sink is not None and bool(torch.isnan(cap.attn_sink.float()).any())  # +-inf is defined
    bad_kv = (~torch.isfinite(ref_out).all(dim=-1) & live[..., None]).any(dim=1).any(dim=1) & ~bad_q.any(dim=1)  # [B]
    found = []
    for b in range(B):
        if not bool(live[b].any()):
            continue
        heads = torch.nonzero(bad_q[b]).flatten().tolist()
        where = ([f"q (heads {', '.join(map(str, heads))})"] if heads else []) + (["attn_sink"] if sink_bad else []) + (
            ["the attended cache bytes (k_cache / extra_k_cache values or scales)"] if bool(bad_kv[b]) and not sink_bad else [])
        if not where:
            continue
        rid = cap.meta.rids[b] if cap.meta.rids is not None and b < len(cap.meta.rids) else None
        what = " and ".join(where)
        found.append(Finding("nonfinite_input", "warning", f"{request_label(b, rid)}: NaN/Inf in {what}: {UPSTREAM}",
                             request=b, rid=rid, numbers={"q_heads": heads, "where": what}))  # fmt: skip
    return found


def file_meta(path: Any) -> dict:
    """The raw ``meta`` JSON of a capture file ({} when it has none or cannot be read): to tell a
    sparse capture from a dense one before choosing the reader."""
    try:
        with safetensors_open(path) as f:
            return meta_json((f.metadata() or {}).get("meta", "{}"))
    except Exception:
        return {}


def is_sparse_file(path: Any) -> bool:
    """A regular file whose meta says sparse decode; any path the OS refuses (a name too long, no
    permission) is not, and the dense reader names the file and the reason."""
    try:
        return Path(path).is_file() and is_sparse_meta(file_meta(path))
    except (OSError, ValueError):
        return False


def _sparse_meta(path: Path, header: dict) -> SparseMeta:
    if header.get("format") != CAPTURE_FORMAT:
        raise CaptureError(path, "header key 'format'", f"expected {CAPTURE_FORMAT!r}, got {header.get('format')!r}")
    try:
        return parse_sparse_meta(meta_json(header.get("meta", "null")), path)
    except (json.JSONDecodeError, TypeError, AttributeError):
        raise CaptureError(path, "header key 'meta'", "missing or not a JSON object") from None
    except CaptureError:  # a ValueError naming its key already
        raise
    except ValueError as e:  # a number JSON can hold but Python refuses to parse (an int of 4,400 digits)
        raise CaptureError(path, "header key 'meta'", f"a number out of range: {str(e).split(';')[0]}") from None


def read_sparse(path: Any) -> SparseCapture:
    """Open, validate and load a sparse capture. Raises CaptureError (file + tensor/key + reason)."""
    path = Path(path)
    meta, loaded, names = open_capture(path, TENSORS, _sparse_meta)
    cap = SparseCapture(path=str(path), meta=meta, **loaded)
    validate(cap)
    unknown = sorted(names - set(TENSORS))
    if unknown:
        cap.warnings.append(f"tensors not in the sparse capture format, ignored: {', '.join(unknown)}")
    return cap


def write_sparse(path: Any, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> Path:
    """Validate, then write atomically (the file appears under its name only once complete)."""
    from safetensors.torch import save

    path = Path(path)
    unknown = set(tensors) - set(TENSORS)
    if unknown:
        raise CaptureError(path, f"tensor '{sorted(unknown)[0]}'", "not part of the sparse capture format")
    t = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items() if v is not None}
    parsed = parse_sparse_meta(dict(meta), path)
    validate(SparseCapture(path=str(path), meta=parsed, **t))
    header = {"format": CAPTURE_FORMAT, "meta": json.dumps(parsed.to_json(), sort_keys=True)}
    write_bytes(path, sorted_header(save(t, metadata=header)), make_parents=True)
    return path


__all__ = ["file_meta", "is_sparse_file", "nonfinite_inputs", "problems", "read_sparse", "validate", "write_sparse"]
