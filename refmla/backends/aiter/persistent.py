"""aiter's persistent MLA decode: ``mla_decode_fwd`` with the work buffers, as SGLang 0.5.23 calls it.

SGLang's ``_forward_mla_decode`` (persistent, no DCP):

    q           [B, Hk, 576]   head-padded (refmla.backends.aiter.heads); fp8 only when SGLang
                               quantized it (q_scale then its scale), else bf16 with q_scale = kv scale
    kv_buffer   [N, 1, 1, 576] the pool viewed as one-token pages, whatever the server page size
    qo_indptr = arange(B + 1), kv_indptr / kv_indices token-level, kv_last_page_lens = ones
    max_seqlen_q = 1, sm_scale, logit_cap,
    work_meta_data, work_indptr, work_info_set, reduce_indptr, reduce_final_map, reduce_partial_map
                               (refmla.backends.aiter.metadata, rebuilt for this batch)
    q_scale, kv_scale          [1] fp32 for an fp8 pool, else None
    intra_batch_mode           the one the metadata was built with
    num_kv_splits              max_split_per_batch (None with SGLANG_AITER_MLA_AUTO_KV_SPLITS)

Before the call SGLang zeroes pool row 0 (the kernel reads it, weighted by 0, for masked
positions; CUDA-graph padding writes there). Here row 0 is zeroed, in a copy, only when no request
attends it (a compacted capture renumbers rows: its row 0 is real) and it holds NaN / Inf.
"""

from __future__ import annotations

from typing import Optional

import torch

from refmla.backends.aiter import heads
from refmla.backends.aiter.indices import AiterCall, aiter_decode_args, call_kernel, kernel_kwargs, output_buffer
from refmla.backends.aiter.metadata import build_metadata, compare_buffers, plan_modes
from refmla.backends.aiter.paths import AiterPath
from refmla.backends.aiter.probe import locate_aiter
from refmla.backends.base import BackendUnavailable, BackendFinding
from refmla.scales import Scales

FP8_DTYPES = {"float8_e4m3fn": torch.float8_e4m3fn, "float8_e4m3fnuz": torch.float8_e4m3fnuz}


def quantize_q(q: torch.Tensor, path: AiterPath) -> tuple[torch.Tensor, Optional[float], str]:
    """(q as the production kernel got it, its scale or None, how): fp8 when production quantized q."""
    want = FP8_DTYPES.get(path.q_dtype or "")
    if want is None or q.dtype == want:
        return q, None, "as captured"
    scale = float(path.q_scale) if path.q_scale else 1.0
    return (q.float() / scale).to(want), scale, f"quantized to {path.q_dtype} with q_scale {scale}"


def _row0(kv_buffer: torch.Tensor, kv_indices: torch.Tensor) -> tuple[torch.Tensor, str]:
    """SGLang's ``k_buffer_flat[0].zero_()``, mirrored only where it cannot change what is attended."""
    if kv_buffer.shape[0] == 0 or bool(torch.isfinite(kv_buffer[0].float()).all()):
        return kv_buffer, "row 0 finite: left as captured"
    if bool((kv_indices == 0).any()):
        return kv_buffer, "row 0 holds NaN/Inf but is attended (compacted capture): left as captured"
    kv = kv_buffer.clone()
    kv[0].zero_()
    return kv, "row 0 held NaN/Inf and is not attended: zeroed, as SGLang does"


def run_persistent_decode(q: torch.Tensor, kv_buffer: torch.Tensor, kv_indptr: torch.Tensor,
                          kv_indices: torch.Tensor, sc: Scales, path: AiterPath, call: AiterCall = AiterCall(),
                          captured: Optional[dict] = None) -> tuple[torch.Tensor, dict, list[BackendFinding]]:  # fmt: skip
    """aiter's persistent mla_decode_fwd on plain tensors: (out [B, H, Dv] on CPU, info, findings)."""
    mla, version, standin = locate_aiter()
    fn = mla.mla_decode_fwd
    dev = torch.device(call.device or ("cpu" if standin else "cuda"))
    B, D = q.shape[0], q.shape[2]
    fp8_kv = kv_buffer.dtype.itemsize == 1
    q_pad, unpad, pad_how = heads.pad_heads(q.to(dev).contiguous())
    Hk = int(q_pad.shape[1])
    q_in, q_scale, q_how = quantize_q(q_pad, path)
    kv_buffer, row0 = _row0(kv_buffer, kv_indices)
    args, convention = aiter_decode_args(q_in, kv_buffer, kv_indptr, kv_indices, page_size=1, device=dev)
    buffers, calls = build_metadata(path, args["qo_indptr"], args["kv_indptr"], args["kv_last_page_lens"],
                                    kernel_heads=Hk, kv_dtype=kv_buffer.dtype, page_size=call.page_size, device=dev)  # fmt: skip
    findings = compare_buffers(captured or {}, buffers)
    fast, intra, splits = plan_modes(path, Hk)
    num_kv_splits = None if path.auto_kv_splits else (path.num_kv_splits if path.num_kv_splits is not None else splits)
    f32 = dict(dtype=torch.float32, device=dev)
    kv_s = torch.tensor([float(sc.k_scale)], **f32) if fp8_kv else None
    q_s = torch.tensor([q_scale], **f32) if q_scale is not None else kv_s
    o = output_buffer((B, Hk, int(sc.kv_lora_rank)), call.out_dtype or q.dtype, dev, call.fill)  # [B, Hk, Dv]
    values = dict(q=q_in, o=o, sm_scale=float(sc.sm_scale), logit_cap=float(sc.logit_cap), q_scale=q_s, kv_scale=kv_s,
                  intra_batch_mode=intra, num_kv_splits=num_kv_splits, **args, **buffers)  # fmt: skip
    kwargs = kernel_kwargs(fn, values)
    if "work_meta_data" not in kwargs:
        raise BackendUnavailable(f"production ran aiter's persistent kernel, not replayed here: aiter {version}'s "
                                 "mla_decode_fwd takes no work_meta_data")  # fmt: skip
    seconds = call_kernel(fn, kwargs, dev)
    info = {
        "aiter_version": version, "kernel": "aiter.mla.mla_decode_fwd (persistent)", "stand_in": standin,
        "device": str(dev), "index_convention": convention, "page_size": 1, "head_padding": pad_how,
        "kernel_heads": Hk, "q": q_how, "kernel_params": sorted(kwargs), "metadata_calls": calls,
        "fast_mode": fast, "intra_batch_mode": intra, "num_kv_splits": num_kv_splits, "kv_row0": row0,
        "metadata_compared": sorted(k for k, v in (captured or {}).items() if v is not None),
        "kernel_seconds": seconds,
    }  # fmt: skip
    gate = getattr(mla, "_use_persistent_mla_decode", None)
    if callable(gate) and num_kv_splits is None and not gate(B, Hk, 1, q_in.dtype, kv_buffer.dtype):
        info["notes"] = ["aiter's _use_persistent_mla_decode falls back to the non-persistent kernel for this batch"]
    return unpad(o).cpu(), info, findings


__all__ = ["FP8_DTYPES", "quantize_q", "run_persistent_decode"]
