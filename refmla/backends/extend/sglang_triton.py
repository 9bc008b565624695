"""SGLang's Triton extend kernel (``extend_attention_fwd``): where it lives, whether it runs here,
and one call of it on the prefix / new-token split, by keyword from its signature."""

from __future__ import annotations

import importlib
import inspect
import math
import time
from typing import Any, Callable, Optional

import numpy as np
import torch

from refmla.backends import triton_interp
from refmla.backends.calling import find_function, kwargs_for
from refmla.backends.extend.inputs import ExtendInputs
from refmla.scales import Scales

# Where SGLang keeps the extend kernel: from 0.5.16 on, then up to 0.5.15.
EXTEND_KERNEL_MODULES = (
    "sglang.kernels.ops.attention.extend_attention",
    "sglang.srt.layers.attention.triton_ops.extend_attention",
)

_located: Optional[tuple[Callable, str]] = None


def locate_extend_kernel() -> tuple[Callable, str]:
    """(extend_attention_fwd, its module path), the new path first. Raises RuntimeError saying why not."""
    global _located
    if _located is not None:
        return _located
    triton_interp.ensure_interpreter()  # before the first import of triton
    _located = find_function(EXTEND_KERNEL_MODULES, "extend_attention_fwd", "SGLang's Triton extend kernel")
    return _located


def _sglang_version() -> str:
    try:
        from importlib.metadata import version

        return version("sglang")
    except Exception:
        return "unknown"


def triton_extend_status() -> tuple[bool, str]:
    """(runnable here, note): SGLang's kernel found and either a GPU or the interpreter (bf16 fix)."""
    ok, how = triton_interp.triton_ready()
    if not ok:
        return False, how
    import triton
    try:
        fn, path = locate_extend_kernel()
    except Exception as e:
        return False, str(e)
    ok, where = triton_interp.where_kernel_runs(importlib.import_module(path))
    if not ok:
        return False, where
    return True, f"sglang {_sglang_version()} {path}.{fn.__name__}, triton {triton.__version__}, {where}"


def run_triton_extend(
    inp: ExtendInputs, kv_buffer: torch.Tensor, sc: Scales, out_dtype: torch.dtype = torch.bfloat16,
    device: Optional[torch.device] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor], dict]:  # fmt: skip
    """SGLang's ``extend_attention_fwd`` on the prefix/new-token split: out [T, H, Dv], lse [T, H] or None, info."""
    fn, path = locate_extend_kernel()
    interpreted = _interpreted_with_fix(path)
    dev = torch.device(device or ("cpu" if interpreted else "cuda"))
    T, H, _ = inp.q_extend.shape
    wants_lse = "lse_extend" in inspect.signature(fn).parameters
    lse = torch.full((T, H), math.nan, dtype=torch.float32, device=dev) if wants_lse else None  # [T, H]
    o = torch.full((T, H, int(sc.kv_lora_rank)), math.nan, dtype=out_dtype, device=dev)  # [T, H, Dv]
    kwargs = kwargs_for(fn, _kernel_values(inp, kv_buffer, o, lse, sc, dev))
    seconds = _call(fn, kwargs, T, dev)
    info = {
        "kernel": f"{path}.{fn.__name__}",
        "sglang_version": _sglang_version(),
        "interpreter": interpreted,
        "device": str(dev),
        "kernel_params": sorted(kwargs),
        "page_size_passed": 1,  # token slots: the kernel's page arithmetic is the identity on them
        "kernel_seconds": round(seconds, 3),
    }
    if inp.custom_mask is not None:
        info["custom_mask"] = inp.mask_source
    if interpreted and kv_buffer.dtype.itemsize == 1:
        info["note"] = "fp8 pool in the Triton interpreter: its fp8 conversions are not verified by refmla"
    return o.cpu(), (lse.cpu() if lse is not None else None), info


def _interpreted_with_fix(path: str) -> bool:
    """Whether the kernel module runs in the interpreter; there, refmla's bf16 dot fix is required."""
    interpreted = bool(triton_interp.module_is_interpreted(importlib.import_module(path)))
    if interpreted:
        ok, note = triton_interp.install_bf16_dot_fix()
        if not ok:
            raise RuntimeError(f"bf16 in the Triton interpreter needs refmla's fix: {note}")
    return interpreted


def _kernel_values(
    inp: ExtendInputs,
    kv_buffer: torch.Tensor,
    o: torch.Tensor,
    lse: Optional[torch.Tensor],
    sc: Scales,
    dev: torch.device,
) -> dict[str, Any]:
    """Every value refmla can give ``extend_attention_fwd``, by parameter name, on ``dev``."""
    Dv = o.shape[-1]
    i32 = torch.int32 if kv_buffer.shape[0] < 2**31 else torch.int64
    kvb = kv_buffer.to(dev)
    return dict(
        q_extend=inp.q_extend.to(dev).contiguous(), k_extend=inp.k_extend.to(dev).contiguous(),
        v_extend=inp.v_extend.to(dev).contiguous(), o_extend=o, k_buffer=kvb, v_buffer=kvb[..., :Dv],
        qo_indptr=inp.qo_indptr.to(dev, torch.int32), kv_indptr=inp.prefix_indptr.to(dev, i32),
        kv_indices=inp.prefix_indices.to(dev, i32), is_causal=True,
        custom_mask=None if inp.custom_mask is None else inp.custom_mask.to(dev).contiguous(),
        mask_indptr=None if inp.mask_indptr is None else inp.mask_indptr.to(dev, torch.int64),
        max_len_extend=inp.max_len_extend, k_scale=float(sc.k_scale), v_scale=float(sc.v_scale),
        sm_scale=float(sc.sm_scale), logit_cap=float(sc.logit_cap), lse_extend=lse, page_size=1,
    )  # fmt: skip


def _call(fn: Callable, kwargs: dict[str, Any], num_tokens: int, dev: torch.device) -> float:
    """Run the kernel (nothing to do without new tokens); its wall time in seconds."""
    t0 = time.perf_counter()
    if num_tokens:
        # the interpreter computes log(0) for rows with no key before masking them: not a finding
        with torch.no_grad(), np.errstate(divide="ignore", invalid="ignore"):
            fn(**kwargs)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return time.perf_counter() - t0


__all__ = ["EXTEND_KERNEL_MODULES", "locate_extend_kernel", "run_triton_extend", "triton_extend_status"]
