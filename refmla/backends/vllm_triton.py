"""The ``vllm_triton`` backend: vLLM's TRITON_MLA decode kernel, run on the captured inputs.

vLLM's ``decode_attention_fwd`` (``vllm.v1.attention.ops.triton_decode_attention``, adapted from
SGLang's) reads a **block table** ``req_to_token [B, M]`` of pages of ``page_size`` rows, and
splits every request uniformly into one batch-wide constexpr count of splits:

    stage 1  grid (B, head tiles, S): split s of request b attends [s * per, min((s + 1) * per, L_b)),
             per = ceil(L_b / S)   (no 32-token rounding: the capture's split_schedule "uniform"),
             stores acc / e_sum and e_max + log(e_sum) in attn_logits [B, H, S, Dv + 1] fp32;
             an fp8 cache is dequantized on load (k * k_scale, v * v_scale, to q's dtype);
             a bf16 / fp16 cache ignores both scales
    stage 2  merges the non-empty splits; a request with no token gets 0 / 0 (NaN)

``TritonMLAImpl.forward_mqa`` picks S = min(npow2(max(1, max_seq_len // 512)), 2 x SMs)
(:func:`refmla.schedule.vllm_num_kv_splits`) and passes ``k_scale`` for both scales. The kernel
is called by keyword from its signature (refmla.backends.calling), under the Triton interpreter on
a CPU-only machine with refmla's bf16 fixes (refmla.backends.triton_interp), compiled on a GPU.

A capture with a ``block_table`` is replayed through it as is; a token-slot capture (SGLang's)
through a page-size-1 table of its slots, the layout vLLM's ROCM_AITER_MLA builds.
"""

from __future__ import annotations

import importlib
from typing import Any, Optional

import torch

from refmla import blocktable
from refmla.arithmetic import VLLM_TRITON
from refmla.backends import triton_interp
from refmla.backends.base import Backend, BackendResult, BackendUnavailable
from refmla.backends.calling import KernelNotFound, KernelSignatureError, find_function, kwargs_for
from refmla.backends.vllm_compat import vllm_triton_on_cpu
from refmla.backends.triton import call_kernel, device_for, interpreter_ready, unsupported_shape
from refmla.capture import Capture
from refmla.options import ReplayOptions
from refmla.scales import Scales
from refmla.schedule import vllm_num_kv_splits

KERNEL_MODULES = (
    "vllm.v1.attention.ops.triton_decode_attention",  # vLLM >= 0.10
    "vllm.attention.ops.triton_decode_attention",  # older releases
)


def vllm_version() -> str:
    try:
        from importlib.metadata import version

        return version("vllm")
    except Exception:
        return "unknown"


def locate_vllm_kernel():
    """(decode_attention_fwd, module path, vllm version). Selects the interpreter first where
    there is no GPU; raises KernelNotFound with what went wrong at each path."""
    seen, note = vllm_triton_on_cpu()
    if not seen:
        raise KernelNotFound(f"vLLM sees no Triton here ({note}): its kernels are placeholders")
    fn, name = find_function(KERNEL_MODULES, "decode_attention_fwd", "vLLM's Triton MLA decode kernel")
    return fn, name, vllm_version()


def block_table_of(cap) -> tuple[torch.Tensor, int, str]:
    """(block table [B, M], page size, where it came from) the kernel reads for this capture."""
    if cap.block_table is not None:
        return cap.block_table, cap.meta.page_size, "capture block_table"
    return blocktable.from_token_rows(cap.kv_indptr, cap.kv_indices), 1, "page-1 table of the capture's token slots"


def split_count(cap, cu_count: int) -> tuple[int, str]:
    """(S, where it came from): a uniform-schedule capture's own count, else vLLM's rule."""
    if cap.meta.split_schedule == "uniform" and cap.num_kv_splits is not None and cap.batch_size:
        counts = set(cap.num_kv_splits.tolist())
        if len(counts) > 1:
            raise BackendUnavailable(f"vLLM's kernel takes one batch-wide split count; the capture has {sorted(counts)}")
        return counts.pop(), "capture"
    longest = int(cap.seq_lens.max()) if cap.batch_size else 0
    return vllm_num_kv_splits(longest, cu_count), f"vLLM's _compute_num_kv_splits (max_seq_len {longest}, {cu_count} SMs)"


def run_vllm_decode(
    q: torch.Tensor, kv_buffer: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor, *,
    page_size: int, num_kv_splits: int, sc: Scales, out_dtype: Optional[torch.dtype] = None,
    fill: Optional[float] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict]:  # fmt: skip
    """Run vLLM's ``decode_attention_fwd`` (MLA) on plain tensors, on q's device.

    q [B, H, D], kv_buffer [N, 1, D] (N a multiple of page_size; V = its first kv_lora_rank dims),
    block_table [B, M], seq_lens [B], sc the call's scales (kv_lora_rank, sm_scale, logit_cap,
    k_scale, v_scale). Returns out [B, H, Dv], lse [B, H]
    fp32, attn_logits [B, H, S, Dv + 1] fp32 as the kernel leaves them (NaN where unwritten), info.
    ``is_mla`` (V as K's transpose, dequantized with k_scale) where the two scales agree, as
    forward_mqa passes them; else the kernel's separate-V path, which applies v_scale. ``fill``:
    every buffer allocated here (o, lse, attn_logits) filled with it first (refmla sweep's NaN
    fill); None: o zeroed as forward_mqa zeroes it, lse and attn_logits NaN (torch.empty in vLLM).
    """
    fn, module_path, version = locate_vllm_kernel()
    interpreted, dot_fix = interpreter_ready(importlib.import_module(module_path), q, kv_buffer, out_dtype)
    dev, P, Dv, S = q.device, int(page_size), int(sc.kv_lora_rank), int(num_kv_splits)
    B, H, _ = q.shape
    if kv_buffer.shape[0] % P:
        raise ValueError(f"kv_buffer has {kv_buffer.shape[0]} rows, not whole pages of {P}")
    cache = kv_buffer.to(dev).contiguous().unflatten(0, (-1, P))  # [pages, P, 1, D] as forward_mqa
    nan, zero = (float("nan"), 0.0) if fill is None else (float(fill), float(fill))  # forward_mqa zeroes o
    out = torch.full((B, H, Dv), zero, dtype=out_dtype or q.dtype, device=dev)
    lse = torch.full((B, H), nan, dtype=torch.float32, device=dev)
    logits = torch.full((B, H, S, Dv + 1), nan, dtype=torch.float32, device=dev)
    values = dict(
        q=q.contiguous(), k_buffer=cache, v_buffer=cache[..., :Dv], o=out, lse=lse,
        req_to_token=block_table.to(dev, torch.int32).contiguous(), b_seq_len=seq_lens.to(dev, torch.int32),
        attn_logits=logits, num_kv_splits=S, sm_scale=float(sc.sm_scale), page_size=P, logit_cap=float(sc.logit_cap),
        k_scale=torch.tensor([float(sc.k_scale)], dtype=torch.float32, device=dev),
        v_scale=torch.tensor([float(sc.v_scale)], dtype=torch.float32, device=dev), is_mla=sc.k_scale == sc.v_scale,
    )  # fmt: skip
    kwargs = kwargs_for(fn, values)
    seconds = call_kernel(fn, kwargs, dev)
    info = {
        "vllm_version": version, "kernel": f"{module_path}.{fn.__name__}", "device": str(dev),
        "interpreter": interpreted, "bf16_dot_fix": dot_fix, "num_kv_splits": S, "page_size": P,
        "kernel_params": sorted(kwargs), "kernel_seconds": round(seconds, 3), "is_mla": values["is_mla"],
    }  # fmt: skip
    if not values["is_mla"]:
        info["notes"] = ["is_mla=False: the MLA path reads V through K's scale (v = trans(k)); with "
                         "k_scale != v_scale V is loaded and dequantized on its own"]  # fmt: skip
    return out, lse, logits, info


class VllmTritonBackend(Backend):
    name = "vllm_triton"
    fills_buffers = True  # o, lse and attn_logits are allocated here, filled with opts.buffer_fill when given
    modes = ("decode",)

    def availability(self) -> tuple[bool, str]:
        ok, how = triton_interp.triton_ready()
        if not ok:
            return False, how
        try:
            fn, module_path, version = locate_vllm_kernel()
        except Exception as e:
            return False, str(e)
        return True, f"vllm {version} {module_path}.{fn.__name__}"

    def run(self, cap: Capture, opts: ReplayOptions) -> BackendResult:
        m = cap.meta
        if m.mode != "decode":
            raise BackendUnavailable(f"decode kernel; capture is {m.mode} mode")
        ok, why = self.availability()
        if not ok:
            raise BackendUnavailable(why)
        why = unsupported_shape(m.kv_lora_rank, m.qk_rope_head_dim) or _scale_mismatch(cap)
        if why:
            raise BackendUnavailable(why)
        table, P, table_source = block_table_of(cap)
        S, split_source = split_count(cap, opts.cu_count)
        fn, module_path, _ = locate_vllm_kernel()
        device = device_for(module_path, opts)
        try:
            out, lse, logits, info = run_vllm_decode(
                cap.q.to(device), cap.kv_buffer, table, cap.seq_lens, page_size=P, num_kv_splits=S,
                sc=cap.scales(), out_dtype=cap.out_dtype, fill=opts.buffer_fill,
            )  # fmt: skip
        except KernelSignatureError as e:
            raise BackendUnavailable(str(e)) from e
        info.update(block_table=table_source, num_kv_splits_source=split_source, lse_dtype_note=(
            "lse kept fp32 here; forward_mqa allocates it in q's dtype"))  # fmt: skip
        return _result(cap, out, lse, logits, S, info)


def _scale_mismatch(cap) -> Optional[str]:
    """vLLM's kernel dequantizes only an fp8 cache: a wider cache with k_scale / v_scale != 1
    is an input vLLM never makes (the reference would apply the scales, the kernel would not)."""
    m = cap.meta
    if cap.kv_buffer.dtype.itemsize > 1 and (m.k_scale != 1.0 or m.v_scale != 1.0):
        return (f"vLLM's TRITON_MLA applies k_scale / v_scale only to an fp8 cache; this "
                f"{cap.kv_buffer.dtype} pool has k_scale={m.k_scale:g}, v_scale={m.v_scale:g}")  # fmt: skip
    return None


def _result(cap, out, lse, logits, S: int, info: dict[str, Any]) -> BackendResult:
    """The BackendResult: vLLM's own arithmetic (uniform splits of one batch-wide count, q kept, K / V
    dequantized to q's dtype: refmla.arithmetic.VLLM_TRITON) places its partials and builds its control."""
    Dv = cap.meta.kv_lora_rank
    splits = torch.full((cap.batch_size,), S, dtype=torch.int32)
    # stage 1 dequantizes V on load, so its partials carry v_scale; refmla's convention (SGLang's
    # kernel) is partials before v_scale, which the split comparison applies
    info["attn_logits_include_v_scale"] = True
    return BackendResult(
        out=out.cpu(), lse=lse.cpu(), attn_logits=(logits[..., :Dv] / cap.meta.v_scale).cpu(),
        attn_lse=logits[..., Dv].cpu(), num_kv_splits=splits, info=info, arithmetic=VLLM_TRITON,
        defines_empty_rows=False,  # stage 2 divides 0 by 0 for a request with no tokens
    )  # fmt: skip


__all__ = ["KERNEL_MODULES", "VllmTritonBackend", "block_table_of", "locate_vllm_kernel", "run_vllm_decode", "split_count"]
