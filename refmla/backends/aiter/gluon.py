"""aiter's Gluon MLA decode (``aiter.ops.triton.gluon.mla_gluon.mla_gluon``), as SGLang 0.5.23 calls it.

SGLang's ``mla_gluon_decode`` (srt/layers/attention/aiter_mla_gluon.py), one query token each:

    q_nope, q_pe = q.split([Dv, D - Dv], -1)     [B, H, Dv], [B, H, D - Dv]  (no head padding)
    kv_c         = k_buffer.view(-1, D)          [N, D]  (nope and rope in one buffer)
    o            [B, H, Dv]
    page_table   = kv_indices, seq_info = kv_indptr      (1-D: use_2d_view=False)
    sm_scale, k_pe=None, kv_pe_offset=Dv, kv_scale (a float), min_kv_seq_len = max(seq_lens)

Called by keyword from its signature. A release without the module is ``skipped`` naming the path.
"""

from __future__ import annotations


import torch

from refmla.backends.aiter.indices import AiterCall, call_kernel, kernel_kwargs, output_buffer
from refmla.backends.aiter.probe import locate_aiter
from refmla.backends.base import BackendUnavailable
from refmla.backends.calling import KernelNotFound, find_function
from refmla.scales import Scales

GLUON_MODULES = ("aiter.ops.triton.gluon.mla_gluon",)


def run_gluon_decode(q: torch.Tensor, kv_buffer: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                     sc: Scales, call: AiterCall = AiterCall()) -> tuple[torch.Tensor, dict]:  # fmt: skip
    """aiter's Gluon MLA decode on plain tensors: (out [B, H, Dv] on CPU, info)."""
    _, version, standin = locate_aiter()
    try:
        fn, where = find_function(GLUON_MODULES, "mla_gluon", "aiter's Gluon MLA decode")
    except KernelNotFound as e:
        raise BackendUnavailable(f"production ran aiter's gluon kernel, not replayed here: {e}") from None
    dev = torch.device(call.device or ("cpu" if standin else "cuda"))
    B, H, D = q.shape
    Dv = int(sc.kv_lora_rank)
    q_nope, q_pe = q.to(dev).split([Dv, D - Dv], dim=-1)
    lens = (kv_indptr[1:] - kv_indptr[:-1]).long()
    o = output_buffer((B, H, Dv), call.out_dtype or q.dtype, dev, call.fill)
    values = dict(
        q_nope=q_nope, q_pe=q_pe, kv_c=kv_buffer.to(dev).reshape(-1, D), o=o,
        page_table=kv_indices.to(dev, torch.int32).contiguous(), seq_info=kv_indptr.to(dev, torch.int32).contiguous(),
        sm_scale=float(sc.sm_scale), k_pe=None, kv_pe_offset=Dv, use_2d_view=False, kv_scale=float(sc.k_scale),
        min_kv_seq_len=int(lens.max()) if B else 1,
    )  # fmt: skip
    kwargs = kernel_kwargs(fn, values)
    seconds = call_kernel(fn, kwargs, dev)
    info = {
        "aiter_version": version, "kernel": f"{where}.mla_gluon", "stand_in": standin, "device": str(dev),
        "index_convention": "token", "page_size": 1, "head_padding": "none", "kernel_heads": H,
        "kernel_params": sorted(kwargs), "kernel_seconds": seconds,
    }  # fmt: skip
    return o.cpu(), info


__all__ = ["GLUON_MODULES", "run_gluon_decode"]
