"""aiter's ``mla_prefill_fwd`` over the whole sequence (real aiter only; see refmla.backends.aiter)."""

from __future__ import annotations

from typing import Optional

import torch

from refmla.backends.aiter import heads as aiter_heads  # by attribute: a test may patch its pad_heads
from refmla.backends.aiter.indices import kernel_kwargs
from refmla.backends.aiter.probe import locate_aiter
from refmla.backends.base import BackendUnavailable
from refmla.backends.extend.inputs import ExtendInputs
from refmla.capture import Capture


def run_aiter_prefill(cap: Capture, inp: ExtendInputs, out_dtype: torch.dtype, device: Optional[str] = None):
    """aiter.mla.mla_prefill_fwd over the whole sequence (new tokens read from the cache, page size 1)."""
    mla, version, standin = locate_aiter()
    fn = getattr(mla, "mla_prefill_fwd", None)
    if fn is None:
        raise BackendUnavailable(f"aiter {version} has no mla.mla_prefill_fwd")
    m = cap.meta
    dev = torch.device(device or ("cpu" if standin else "cuda"))
    T, _, D = inp.q_extend.shape
    B = cap.batch_size
    # as for decode: 16 heads at least
    q_in, unpad, pad_how = aiter_heads.pad_heads(inp.q_extend.to(dev).contiguous())
    o = torch.empty(T, q_in.shape[1], m.kv_lora_rank, dtype=out_dtype, device=dev)
    values = dict(
        q=q_in, kv_buffer=cap.kv_buffer.to(dev).view(-1, 1, 1, D), o=o,
        qo_indptr=inp.qo_indptr.to(dev, torch.int32), kv_indptr=cap.kv_indptr.to(dev, torch.int32),
        kv_indices=cap.kv_indices.to(dev, torch.int32),
        kv_last_page_lens=torch.ones(B, dtype=torch.int32, device=dev),
        max_seqlen_q=inp.max_len_extend, sm_scale=float(m.sm_scale), logit_cap=float(m.logit_cap),
    )  # fmt: skip
    fn(**kernel_kwargs(fn, values))
    return unpad(o).cpu(), {"kernel": "aiter.mla.mla_prefill_fwd", "aiter_version": version, "stand_in": standin,
                            "head_padding": pad_how}  # fmt: skip


__all__ = ["run_aiter_prefill"]
