"""Rows of a latent KV pool, compared and classified by their bytes (shared by checks, diffkv, series).

    row_flags      all-zero / NaN-Inf / latent-only-zero / rope-only-zero rows, from the bit patterns
    rows_differ    row i of one pool vs row j of another, bit for bit (memcmp per contiguous run)
    row_stats      the numbers of differing row pairs: max abs difference, norms, zero and NaN rows
                   (value_stats: the same of rows already decoded, a packed sparse cache's)
    per_request    per-position flags grouped by an indptr: count and first position per request
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

ROW_CHUNK = 16384  # pool rows tested at a time by row_flags (18 MB of bf16 at D = 576)
CHUNK = 8192  # rows gathered at a time by the comparisons (9 MB per side at 576 bf16)


def per_request(flags: torch.Tensor, indptr: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position flags [nnz] grouped by ``indptr`` [B + 1] -> (count [B], first position [B]).

    ``first`` is the position within the request (0-based) of the first flagged entry, -1 if none.
    """
    indptr = indptr.long()
    c = torch.zeros(flags.numel() + 1, dtype=torch.int64)
    c[1:] = torch.cumsum(flags.long(), 0)  # [nnz + 1]
    count = c[indptr[1:]] - c[indptr[:-1]]  # [B]
    hit = torch.nonzero(flags).flatten()  # [K] sorted
    k = torch.searchsorted(hit, indptr[:-1])  # [B] first hit at or after each request's start
    first = torch.full_like(count, -1)
    has = count > 0
    first[has] = hit[k[has]] - indptr[:-1][has]
    return count, first


# dtype -> (integer view, mask that drops the sign bit (zero test), (mask, value) of NaN/Inf bit patterns)
_BITS = {
    torch.bfloat16: (torch.int16, 0x7FFF, (0x7F80, 0x7F80)),
    torch.float16: (torch.int16, 0x7FFF, (0x7C00, 0x7C00)),
    torch.float32: (torch.int32, 0x7FFFFFFF, (0x7F800000, 0x7F800000)),
    torch.float64: (torch.int64, 0x7FFFFFFFFFFFFFFF, (0x7FF0000000000000, 0x7FF0000000000000)),
    torch.float8_e4m3fn: (torch.uint8, 0x7F, (0x7F, 0x7F)),  # no Inf; NaN is S.1111.111
    torch.float8_e5m2: (torch.uint8, 0x7F, (0x7C, 0x7C)),
    torch.float8_e4m3fnuz: (torch.uint8, 0xFF, (0xFF, 0x80)),  # no -0; 0x80 is the NaN
    torch.float8_e5m2fnuz: (torch.uint8, 0xFF, (0xFF, 0x80)),
}


def row_flags(kv_buffer: torch.Tensor, rows: torch.Tensor, kv_lora_rank: int) -> dict[str, torch.Tensor]:
    """For each pool row in ``rows`` [R]: zero / nonfinite / latent_zero / rope_zero, bool [R].

    Tested on the bit patterns (numpy, in chunks): a value is zero when all its bits but the
    sign are, NaN/Inf when its exponent bits are all ones (fp8 formats by their own rules).
    """
    R = rows.numel()
    out = {k: np.zeros(R, dtype=bool) for k in ("zero", "nonfinite", "latent_zero", "rope_zero")}
    if kv_buffer.dtype not in _BITS:
        raise TypeError(f"kv_buffer dtype {kv_buffer.dtype} has no bit layout here")
    view, zmask, (emask, evalue) = _BITS[kv_buffer.dtype]
    N, D = kv_buffer.shape[0], kv_buffer.shape[-1]
    bits = kv_buffer.reshape(N, D).contiguous().view(view).numpy()  # [N, D] no copy
    r = rows.long().numpy()
    dense = R > 0 and int(r[-1]) - int(r[0]) == R - 1 and bool((r[1:] > r[:-1]).all())
    Dv = min(kv_lora_rank, D)
    for s in range(0, R, ROW_CHUNK):
        e = min(s + ROW_CHUNK, R)
        v = bits[r[s] : r[s] + e - s] if dense else bits[r[s:e]]  # [c, D]
        lat = (v[:, :Dv] & zmask).any(1)  # latent part holds a nonzero
        rope = (v[:, Dv:] & zmask).any(1) if D > Dv else np.zeros(e - s, dtype=bool)
        out["zero"][s:e] = ~lat & ~rope
        out["latent_zero"][s:e] = ~lat
        out["rope_zero"][s:e] = ~rope if D > Dv else False
        out["nonfinite"][s:e] = ((v & emask) == evalue).any(1)
    return {k: torch.from_numpy(v) for k, v in out.items()}



def row_words(kv_buffer: torch.Tensor) -> torch.Tensor:
    """kv_buffer [N, 1, D] -> its bytes as [N, W] integers, the widest word that divides a row."""
    N, D = kv_buffer.shape[0], kv_buffer.shape[-1]
    nbytes = D * kv_buffer.element_size()
    word = next(w for w in (8, 4, 2, 1) if nbytes % w == 0)
    raw = kv_buffer.reshape(N, D).contiguous().view(torch.uint8)  # [N, nbytes]
    return raw.view({8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[word])


def rows_differ(pool_a: torch.Tensor, rows_a: torch.Tensor, pool_b: torch.Tensor, rows_b: torch.Tensor) -> torch.Tensor:
    """bool [M]: row ``rows_a[i]`` of pool_a differs from row ``rows_b[i]`` of pool_b.

    Bit for bit when both pools have the same dtype; by value (NaN equal to NaN) otherwise.

    Positions whose rows are consecutive in both pools (a page, or a longer transfer run) form a
    run; when runs are long (pages of 16 and more), each is compared in place with one memcmp and
    nothing is copied -- each byte of both pools is read once. Otherwise rows are gathered in
    chunks (sorted by pool_b row, so that a densely used pool_b is read as slices, not gathered).
    """
    M = rows_a.numel()
    if pool_a.dtype != pool_b.dtype:
        return _rows_differ_by_value(pool_a, rows_a, pool_b, rows_b)
    out = np.zeros(M, dtype=bool)
    if M == 0:
        return torch.from_numpy(out)
    wa, wb = row_words(pool_a).numpy(), row_words(pool_b).numpy()  # [N, W] views, no copy
    ra, rb = rows_a.long().numpy(), rows_b.long().numpy()
    brk = np.flatnonzero((ra[1:] != ra[:-1] + 1) | (rb[1:] != rb[:-1] + 1)) + 1
    starts = np.concatenate([[0], brk])
    memcmp = _memcmp()
    if memcmp is not None and M >= MIN_RUN * starts.size:
        ends = np.concatenate([brk, [M]])
        rowbytes = wa.shape[1] * wa.itemsize
        pa, pb = wa.ctypes.data, wb.ctypes.data
        for s, e, a0, b0 in zip(starts.tolist(), ends.tolist(), ra[starts].tolist(), rb[starts].tolist()):
            if memcmp(pa + a0 * rowbytes, pb + b0 * rowbytes, (e - s) * rowbytes):
                out[s:e] = (wa[a0 : a0 + e - s] != wb[b0 : b0 + e - s]).any(1)
        return torch.from_numpy(out)
    order = np.argsort(rb, kind="stable")
    sa, sb = ra[order], rb[order]
    for s in range(0, M, CHUNK):
        e = min(s + CHUNK, M)
        b0, b1 = int(sb[s]), int(sb[e - 1])
        b = wb[b0 : b1 + 1] if b1 - b0 == e - s - 1 else wb[sb[s:e]]  # [c, W]
        a = wa[sa[s:e]]  # [c, W]
        if not _equal(a, b, memcmp):
            out[order[s:e]] = (a != b).any(1)
    return torch.from_numpy(out)


MIN_RUN = 8  # average run length (rows) from which runs are compared in place


def _memcmp():
    """libc memcmp through ctypes, or None where there is none."""
    global _MEMCMP
    if _MEMCMP is False:
        try:
            import ctypes
            import ctypes.util

            f = ctypes.CDLL(ctypes.util.find_library("c")).memcmp
            f.argtypes, f.restype = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t], ctypes.c_int
            _MEMCMP = f
        except Exception:
            _MEMCMP = None
    return _MEMCMP


_MEMCMP: Any = False


def _equal(a: np.ndarray, b: np.ndarray, memcmp) -> bool:
    """Two C-contiguous arrays of one shape and dtype hold the same bytes."""
    if memcmp is not None and a.flags.c_contiguous and b.flags.c_contiguous:
        return memcmp(a.ctypes.data, b.ctypes.data, a.nbytes) == 0
    return bool(np.array_equal(a, b))


def _rows_differ_by_value(pool_a, rows_a, pool_b, rows_b) -> torch.Tensor:
    M = rows_a.numel()
    out = torch.empty(M, dtype=torch.bool)
    fa, fb = pool_a[:, 0], pool_b[:, 0]
    for s in range(0, M, CHUNK):
        a = fa.index_select(0, rows_a[s : s + CHUNK]).double()  # [c, D]
        b = fb.index_select(0, rows_b[s : s + CHUNK]).double()
        same = (a == b) | (torch.isnan(a) & torch.isnan(b))
        out[s : s + CHUNK] = ~same.all(1)
    return out


def row_stats(
    pool_a: torch.Tensor, rows_a: torch.Tensor, pool_b: torch.Tensor, rows_b: torch.Tensor
) -> dict[str, torch.Tensor]:
    """For row pairs (a, b): max abs difference over finite elements, fp64 norms, zero rows,
    elements that differ and NaN/Inf elements on either side; each [M]."""
    fa, fb = pool_a[:, 0], pool_b[:, 0]
    parts = [value_stats(fa.index_select(0, rows_a[s : s + CHUNK]).double(), fb.index_select(0, rows_b[s : s + CHUNK]).double())
             for s in range(0, rows_a.numel(), CHUNK)]  # fmt: skip
    if not parts:
        return value_stats(torch.zeros(0, 1, dtype=torch.float64), torch.zeros(0, 1, dtype=torch.float64))
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


def value_stats(a: torch.Tensor, b: torch.Tensor) -> dict[str, torch.Tensor]:
    """:func:`row_stats` of row values already gathered, a and b [M, D] fp64 (a packed cache's rows
    decoded: refmla.diffkv.views)."""
    fin = torch.isfinite(a) & torch.isfinite(b)
    return {
        "max_abs_diff": torch.where(fin, (a - b).abs(), 0).amax(1) if a.shape[1] else torch.zeros(a.shape[0], dtype=torch.float64),
        "norm_a": torch.where(torch.isfinite(a), a, 0).norm(dim=1),
        "norm_b": torch.where(torch.isfinite(b), b, 0).norm(dim=1),
        "differing_dims": (~((a == b) | (torch.isnan(a) & torch.isnan(b)))).sum(1),
        "nonfinite_a": (~torch.isfinite(a)).sum(1),
        "nonfinite_b": (~torch.isfinite(b)).sum(1),
        "zero_a": (a == 0).all(1),
        "zero_b": (b == 0).all(1),
    }
