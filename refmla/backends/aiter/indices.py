"""The index arguments of aiter's ``mla_decode_fwd`` and keyword calls by signature.

    q           [B, Hk, 576]          Hk = 16 for H < 16 (refmla.backends.aiter.heads), else H
    kv_buffer   [N, 1, 1, 576]        page size 1: the pool viewed as one-token pages
                [N / P, P, 1, 576]    page-level mode, P = the capture's page_size
    qo_indptr   arange(B + 1)         int32, one query token per request
    kv_indptr   [B + 1]               int32, over tokens (page size 1) or pages (page-level)
    kv_indices                        int32, token slots (page size 1) or page ids (page-level)
    kv_last_page_lens                 int32, ones (page size 1) or the last page's fill (page-level)
    max_seqlen_q = 1, page_size, nhead_kv = 1

The call is built by keyword from ``inspect.signature``: aiter v0.1.11 inserted ``page_size`` and
``nhead_kv`` before ``sm_scale``, so a positional call is wrong on one side of that release. Older
aiter reads the page size from ``kv_buffer.shape[1]``, which the view already sets.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from refmla.backends.calling import kwargs_for
from refmla.paged import token_to_page

# Parameters refmla fills, and names some releases use for the same thing.
_ALIASES = {"max_seqlen_qo": "max_seqlen_q"}



@dataclass(frozen=True)
class AiterCall:
    """How one aiter kernel is called, besides its tensors and scales (run, persistent, gluon)."""

    out_dtype: Optional[torch.dtype] = None  # default q's
    device: Optional[torch.device] = None  # default CUDA (CPU for the test stand-in)
    page_size: int = 1  # the page size the index arguments are built for (refmla.paged)
    fill: Optional[float] = None  # ReplayOptions.buffer_fill: ``o`` filled with it first (None: torch.empty)


def output_buffer(shape: tuple, dtype: torch.dtype, device: torch.device, fill: Optional[float]) -> torch.Tensor:
    """The ``o`` the adapter hands aiter's kernel: torch.empty as aiter's callers allocate it, or
    filled with ``fill`` first (refmla sweep's nan_fill check: a row never written stays NaN)."""
    if fill is None:
        return torch.empty(shape, dtype=dtype, device=device)
    return torch.full(shape, fill, dtype=dtype, device=device)

def kernel_kwargs(fn: Callable, values: dict[str, Any]) -> dict[str, Any]:
    """Keyword arguments for an aiter kernel by its signature (see refmla.backends.calling)."""
    return kwargs_for(fn, values, aliases=_ALIASES)


def call_kernel(fn: Callable, kwargs: dict[str, Any], device: torch.device) -> float:
    """Run an aiter kernel (it writes its outputs in place); the seconds it took, device included."""
    t0 = time.perf_counter()
    with torch.no_grad():
        fn(**kwargs)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return round(time.perf_counter() - t0, 3)


def aiter_decode_args(
    q: torch.Tensor,
    kv_buffer: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    *,
    page_size: int = 1,
    device: Optional[torch.device] = None,
) -> tuple[dict[str, Any], str]:
    """The index arguments of mla_decode_fwd and the index convention used ("token" or "page").

    page_size > 1 converts SGLang's token slots to aiter pages (refmla.paged.token_to_page); a
    pool whose slots are not page-aligned (a compacted capture) falls back to page size 1.
    """
    dev = device or q.device
    B, D = q.shape[0], q.shape[2]
    i32 = dict(device=dev, dtype=torch.int32)
    convention, P = "token", 1
    if page_size > 1:
        try:
            page_indptr, page_indices, last = token_to_page(kv_indptr.long().cpu(), kv_indices.long().cpu(), page_size)
            convention, P = "page", int(page_size)
        except ValueError as e:
            convention = f"token (page_size {page_size} not usable: {e})"
    if P > 1:
        N = kv_buffer.shape[0]
        if N % P:  # whole pages only: pad the pool's tail (never attended)
            kv_buffer = torch.cat([kv_buffer, kv_buffer.new_zeros(P - N % P, *kv_buffer.shape[1:])])
        args = dict(kv_buffer=kv_buffer.to(dev).view(-1, P, 1, D), kv_indptr=page_indptr.to(**i32),
                    kv_indices=page_indices.to(**i32), kv_last_page_lens=last.to(**i32), page_size=P)  # fmt: skip
    else:
        args = dict(kv_buffer=kv_buffer.to(dev).view(-1, 1, 1, D), kv_indptr=kv_indptr.to(**i32),
                    kv_indices=kv_indices.to(**i32), kv_last_page_lens=torch.ones(B, **i32), page_size=1)  # fmt: skip
    args.update(qo_indptr=torch.arange(B + 1, **i32), max_seqlen_q=1, nhead_kv=1)
    return args, convention


__all__ = ["AiterCall", "aiter_decode_args", "call_kernel", "kernel_kwargs", "output_buffer"]
