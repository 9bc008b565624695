"""One cache of a sparse decode capture (refmla.sparse.format, its KV map) as the rows diff-kv compares.

A :class:`CacheRows` has what the diff reads of a dense capture, so the one diff (refmla.diffkv.diff)
runs on it unchanged: each token's packed bytes as one row (``kv_buffer`` [N, 1, bytes] uint8: fp8
values, bf16 rope and scales together, compared exactly; refmla.sparse.layouts.token_rows), the
request's token per position (``kv_indices``, -1 where the cache does not hold it), the physical
slots through the page map (``orig_kv_indices``), ``seq_lens``, and ``meta`` (the cache's page
size, the rids). Its rows' values (:meth:`CacheRows.row_values`) are the exact fp64 decode, for the
numbers of the mismatched rows only.

    cache names   ``window`` (V4's main cache, the sliding window), ``main`` (V3.2's one latent cache),
                  ``compressed`` (V4's C4 / C128 cache: position i is compressed entry i)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from refmla.capture import CaptureError
from refmla.sparse.format import KV_MAP, SparseCapture
from refmla.sparse.layouts import row_sections, sections, token_rows, token_values
from refmla.util import dtype_name


@dataclass
class _Meta:
    page_size: int
    rids: Optional[list]


def cache_names(cap: SparseCapture) -> list[str]:
    """The caches of a capture, main first: ``window`` / ``main``, then ``compressed`` when it has one."""
    main = "window" if cap.meta.kv_layout == "v4" or cap.meta.window is not None else "main"
    return [main] + (["compressed"] if cap.extra_k_cache is not None else [])


def cache_label(name: str, ratio: Optional[int]) -> str:
    """"window cache", "main cache", "compressed cache (C4)"."""
    return f"compressed cache (C{ratio})" if name == "compressed" and ratio else f"{name} cache"


class CacheRows:
    """One cache of one sparse capture, as a dense capture's rows (module docstring)."""

    is_decode = True  # each capture's positions are its own: the owner of a position is the last capture holding it
    qo_indptr = None

    def __init__(self, cap: SparseCapture, name: str):
        extra = name == "compressed"
        m = cap.meta
        self.path, self.name, self.ratio = cap.path, name, m.compress_ratio
        self.layout = m.extra_layout if extra else m.layout
        self.page = m.extra_page_size if extra else m.page_size
        self.fp8 = m.kv_fp8_dtype
        n_ptr, n_slots, n_pages = KV_MAP["extra_" if extra else ""]
        ptr, slots, pages = getattr(cap, n_ptr), getattr(cap, n_slots), getattr(cap, n_pages)
        if ptr is None or slots is None or cap.seq_lens is None:
            missing = "seq_lens" if cap.seq_lens is None else n_slots
            raise CaptureError(cap.path, f"tensor '{missing}'",
                               f"missing: the {cache_label(name, self.ratio)} cannot be compared position by position "
                               "(a sparse capture's top-k indices name only what one call read; the KV map -- seq_lens, "
                               f"{n_ptr}, {n_slots} -- says which token holds each position, docs/contract.md)")  # fmt: skip
        cache = cap.extra_k_cache if extra else cap.k_cache
        self.kv_buffer = token_rows(cache, self.layout, self.page)[:, None, :]  # [N, 1, bytes] uint8
        self.kv_indptr, self.kv_indices = ptr.long(), slots.long()
        self.seq_lens = self.kv_indptr[1:] - self.kv_indptr[:-1]  # [B] positions each request's list covers
        self.orig_kv_indices = None if pages is None else physical(self.kv_indices, pages.long(), self.page)
        self.meta = _Meta(self.page, m.rids)
        self.kv_token_ids, self.kv_origin = _row_tokens(cap, self.kv_indptr, self.ratio if extra else 1)

    @property
    def label(self) -> str:
        return cache_label(self.name, self.ratio)

    @property
    def batch_size(self) -> int:
        return self.kv_indptr.shape[0] - 1

    def rid(self, b: Optional[int]) -> Optional[str]:
        rids = self.meta.rids
        return rids[b] if b is not None and rids is not None and 0 <= b < len(rids) else None

    def row_values(self, rows: torch.Tensor) -> torch.Tensor:
        """The tokens ``rows`` decoded exactly, fp64 [M, D]."""
        return token_values(row_sections(self.kv_buffer[rows.long(), 0], self.layout), self.layout, self.fp8)

    def zero_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """bool [M]: the tokens whose packed bytes are all zero (never landed)."""
        return (self.kv_buffer[rows.long(), 0] == 0).all(1)

    def sections_differ(self, rows: torch.Tensor, other: "CacheRows", other_rows: torch.Tensor) -> torch.Tensor:
        """int64 [M] bit mask of the sections that differ between row pairs: 1 fp8 values, 2 rope, 4 scales."""
        a, b = self.kv_buffer[rows.long(), 0], other.kv_buffer[other_rows.long(), 0]
        mask = torch.zeros(rows.numel(), dtype=torch.int64)
        for bit, (lo, hi) in zip((1, 2, 4), sections(self.layout).values()):
            mask |= (a[:, lo:hi] != b[:, lo:hi]).any(1).long() * bit
        return mask


def _row_tokens(cap: SparseCapture, ptr: torch.Tensor, ratio: int) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """The cache's token id and origin per position (refmla.capture.rows), from the capture's per-token ones:
    a compressed entry i (``ratio`` > 1) stands for tokens [i * ratio, (i + 1) * ratio): its id is a hash of
    theirs (-1 if one is unknown), so two requests' entries agree as far as whole groups of tokens do; its
    origin is its last token's."""
    if cap.kv_token_ids is None or cap.slot_indptr is None:
        return None, None
    if ratio <= 1:
        return cap.kv_token_ids.long(), None if cap.kv_origin is None else cap.kv_origin.long()
    tok_ptr, ids, org = cap.slot_indptr.long(), [], []
    for b in range(ptr.numel() - 1):
        n = int(ptr[b + 1] - ptr[b])
        t = cap.kv_token_ids[int(tok_ptr[b]) : int(tok_ptr[b]) + n * ratio].long().reshape(n, ratio)  # [n, ratio]
        h = torch.zeros(n, dtype=torch.int64)
        for j in range(ratio):  # polynomial hash mod 2^31 - 1 (token ids below 2^31)
            h = (h * 1000003 + t[:, j] + 1) % 2147483647
        ids.append(torch.where((t < 0).any(1), -1, h))
        o = cap.kv_origin[int(tok_ptr[b]) : int(tok_ptr[b]) + n * ratio].long().reshape(n, ratio)[:, -1] if cap.kv_origin is not None else None
        org.append(o if o is not None else torch.full((n,), -1, dtype=torch.int64))
    cat = lambda xs: torch.cat(xs) if xs else torch.zeros(0, dtype=torch.int64)  # noqa: E731
    return cat(ids), cat(org) if cap.kv_origin is not None else None


SECTION_BITS = {"nope": 1, "rope": 2, "scales": 4}
SECTION_TEXT = {"nope": "fp8 value", "rope": "bf16 rope", "scales": "scale (UE8M0 / fp32)"}


def physical(tokens: torch.Tensor, pages: torch.Tensor, page: int) -> torch.Tensor:
    """Captured tokens -> production slots through the page map (-1 stays -1)."""
    held = tokens >= 0
    t = tokens.clamp_min(0)
    return torch.where(held, pages[t // page] * page + t % page, -1)


def views(prefill: list[SparseCapture], decode: SparseCapture) -> dict[str, tuple[list[CacheRows], CacheRows]]:
    """cache name -> (the prefill captures' rows of it, the decode capture's), after checking that both
    sides hold the same caches in the same layouts (else CaptureError naming the file and the key)."""
    names = cache_names(decode)
    for c in prefill:
        _same_caches(c, decode, names)
    return {n: ([CacheRows(c, n) for c in prefill], CacheRows(decode, n)) for n in names}


def _same_caches(c: SparseCapture, decode: SparseCapture, names: list[str]) -> None:
    if c.meta.kv_layout != decode.meta.kv_layout:
        raise CaptureError(decode.path, "meta key 'kv_layout'", f"{decode.meta.kv_layout}, but prefill capture {c.path} "
                                                               f"has {c.meta.kv_layout}: packed bytes of two layouts "
                                                               "cannot be compared")  # fmt: skip
    theirs = cache_names(c)
    if theirs != names:
        raise CaptureError(decode.path, "tensor 'extra_k_cache'", f"caches {', '.join(names)}, but prefill capture "
                                                                  f"{c.path} has {', '.join(theirs)}: the two sides are "
                                                                  "not the same layer")  # fmt: skip
    for key in ("extra_kv_layout", "compress_ratio"):
        a, b = getattr(decode.meta, key), getattr(c.meta, key)
        if a != b and not (key == "compress_ratio" and None in (a, b)):
            raise CaptureError(decode.path, f"meta key '{key}'", f"{a}, but prefill capture {c.path} has {b}: "
                                                                 "packed bytes of two layouts cannot be compared")  # fmt: skip
    for name, a, b in (("k_cache", decode.k_cache, c.k_cache), ("extra_k_cache", decode.extra_k_cache, c.extra_k_cache)):
        if a is not None and a.dtype != b.dtype:
            raise CaptureError(decode.path, f"tensor '{name}'",
                               f"{dtype_name(a.dtype)}, prefill capture {c.path} {dtype_name(b.dtype)}")


__all__ = ["CacheRows", "SECTION_BITS", "SECTION_TEXT", "cache_label", "cache_names", "physical", "views"]
