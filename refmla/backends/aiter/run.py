"""One call of aiter's ``mla_decode_fwd`` on plain tensors (the non-persistent path)."""

from __future__ import annotations


import torch

from refmla.backends.aiter import heads
from refmla.backends.aiter.indices import AiterCall, aiter_decode_args, call_kernel, kernel_kwargs, output_buffer
from refmla.backends.aiter.probe import locate_aiter
from refmla.backends.base import BackendUnavailable
from refmla.scales import Scales


def check_kv_scales(kv_buffer: torch.Tensor, k_scale: float, v_scale: float) -> bool:
    """Whether the pool is fp8; raises BackendUnavailable for scales aiter cannot take."""
    fp8 = kv_buffer.dtype.itemsize == 1
    if fp8 and k_scale != v_scale:
        raise BackendUnavailable(f"aiter takes one kv_scale; capture has k_scale {k_scale} != v_scale {v_scale}")
    if not fp8 and (k_scale != 1.0 or v_scale != 1.0):
        raise BackendUnavailable(
            f"k_scale/v_scale {k_scale}/{v_scale} on a {kv_buffer.dtype} pool: aiter has no such scales"
        )
    return fp8


def run_aiter_decode(
    q: torch.Tensor,
    kv_buffer: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    sc: Scales,
    call: AiterCall = AiterCall(),
) -> tuple[torch.Tensor, dict]:
    """aiter.mla.mla_decode_fwd on plain tensors: out [B, H, Dv] (on CPU) and an info dict."""
    mla, version, standin = locate_aiter()
    fn = mla.mla_decode_fwd
    dev = torch.device(call.device or ("cpu" if standin else "cuda"))
    B, _, D = q.shape
    Dv, k_scale, v_scale = int(sc.kv_lora_rank), sc.k_scale, sc.v_scale
    if kv_buffer.dim() != 3 or kv_buffer.shape[1] != 1 or kv_buffer.shape[2] != D:
        raise ValueError(f"kv_buffer shape {list(kv_buffer.shape)}, expected [N, 1, {D}]")
    fp8 = check_kv_scales(kv_buffer, k_scale, v_scale)
    q_in, unpad, pad_how = heads.pad_heads(q.to(dev).contiguous())
    args, convention = aiter_decode_args(q_in, kv_buffer, kv_indptr, kv_indices, page_size=call.page_size, device=dev)
    o = output_buffer((B, q_in.shape[1], Dv), call.out_dtype or q.dtype, dev, call.fill)  # [B, Hk, Dv]
    scale = torch.tensor([float(k_scale)], dtype=torch.float32, device=dev) if fp8 else None
    values = dict(
        q=q_in, o=o, sm_scale=float(sc.sm_scale), logit_cap=float(sc.logit_cap), q_scale=scale, kv_scale=scale, **args
    )
    kwargs = kernel_kwargs(fn, values)
    notes = []
    if "page_size" not in kwargs and args["page_size"] > 1:
        notes.append("this aiter has no page_size parameter: it reads the page size from kv_buffer.shape[1]")
    seconds = call_kernel(fn, kwargs, dev)
    info = {
        "aiter_version": version,
        "kernel": "aiter.mla.mla_decode_fwd",
        "stand_in": standin,
        "device": str(dev),
        "index_convention": convention,
        "page_size": args["page_size"],
        "head_padding": pad_how,
        "kernel_heads": int(q_in.shape[1]),
        "kernel_params": sorted(kwargs),
        "kernel_seconds": seconds,
    }
    if notes:
        info["notes"] = notes
    return unpad(o).cpu(), info


__all__ = ["check_kv_scales", "run_aiter_decode"]
