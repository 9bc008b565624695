"""A sparse top-k kernel outside refmla (refmla.kernel, ``layout="sparse_topk"``) as a sparse path:

    SparseCapture --sparse_inputs--> SparseKernelInputs --fn--> KernelOutputs (out [B, S, H, Dv], lse)
                  --sparse_outputs (shapes and dtypes checked; inv_rope applied unless it declares it)--> BackendResult

judged by the one replay (refmla.pipeline.run_backend through refmla.kinds.SparseKind: a child
process, repeats, the control of the SparseArithmetic it declares, localization by request, head
and top-k entry, the sparse mistakes' search), the sparse goldens and the sweep's sparse layout, as
refmla's own sparse kernels (refmla.sparse.backends) are. What does not meet the interface is an
InterfaceError (exit 2); a kernel that raises or crashes is its ``error``.
"""

from __future__ import annotations

import time
from typing import Any, Optional

import numpy as np
import torch

from refmla.backends import get_backend, is_sparse_kernel
from refmla.backends.base import Backend, BackendResult
from refmla.backends.plugin import GUIDE, PluginBackend, expect, said, device_of, interpreter_fixes
from refmla.kernel import InterfaceError, KernelOutputs, SparseKernelInputs
from refmla.options import ReplayOptions
from refmla.sparse.arithmetic import SGLANG_TRITON_SPARSE, SparseArithmetic
from refmla.sparse.backends import PathOutput
from refmla.sparse.format import SparseCapture
from refmla.sparse.layouts import dequantize
from refmla.sparse.reference import inverse_rope


def declared(plugin: PluginBackend) -> SparseArithmetic:
    """The SparseArithmetic a sparse kernel declares (SGLang's Triton sparse kernel's when it declares none)."""
    arith = plugin.spec.sparse_arithmetic
    if arith is None:
        return SGLANG_TRITON_SPARSE
    if not isinstance(arith, SparseArithmetic):
        raise InterfaceError(f"backend {plugin.name}: a sparse_topk kernel declares a refmla.sparse.arithmetic."
                             f"SparseArithmetic, got {type(arith).__name__} ({GUIDE})")  # fmt: skip
    return arith


def sparse_inputs(cap: SparseCapture, device: torch.device) -> SparseKernelInputs:
    """The SparseKernelInputs of a sparse capture: each cache viewed [pages, page_size, 1, bytes per
    token] over its pages (as SGLang's _forward_attention hands it to the kernels) and decoded."""
    m = cap.meta

    def view(cache, layout, page):
        if cache is None:
            return None, None
        pages = cache.to(device)[:, : page * layout.bytes_per_token].contiguous()
        values = dequantize(cache, layout, page, m.kv_fp8_dtype).to(device, torch.float32)  # [P * page, D]
        return pages.view(cache.shape[0], page, 1, layout.bytes_per_token), values

    i32 = lambda t: None if t is None else t.to(device, torch.int32).contiguous()  # noqa: E731
    k, kv = view(cap.k_cache, m.layout, m.page_size)
    ek, ekv = view(cap.extra_k_cache, m.extra_layout, m.extra_page_size)
    return SparseKernelInputs(
        layout="sparse_topk", q=cap.q.to(device).contiguous(), k_cache=k, k_values=kv, kv_layout=m.kv_layout,
        page_size=m.page_size, kv_fp8_dtype=m.kv_fp8_dtype, indices=i32(cap.indices), topk_length=i32(cap.topk_length),
        attn_sink=None if cap.attn_sink is None else cap.attn_sink.to(device, torch.float32),
        extra_k_cache=ek, extra_k_values=ekv, extra_kv_layout=m.extra_kv_layout, extra_page_size=m.extra_page_size,
        extra_indices=i32(cap.extra_indices), extra_topk_length=i32(cap.extra_topk_length),
        softmax_scale=float(m.softmax_scale), head_dim_v=int(m.head_dim_v),
        inv_rope_freqs=None if cap.inv_rope_freqs is None else cap.inv_rope_freqs.to(device),
        inv_rope_positions=None if cap.inv_rope_positions is None else cap.inv_rope_positions.to(device),
    )  # fmt: skip


def sparse_outputs(got: Any, cap: SparseCapture, plugin: PluginBackend) -> PathOutput:
    """out [B, S, H, Dv] bf16 and lse [B, S, H] (or None) of what the kernel returned, checked."""
    name = plugin.name
    B, S, H, _ = cap.q.shape
    Dv = cap.meta.head_dim_v
    if isinstance(got, torch.Tensor):
        got = KernelOutputs(out=got)
    if not isinstance(got, KernelOutputs):
        raise InterfaceError(f"backend {name} returned {said(got)}; expected a refmla.kernel.KernelOutputs or the "
                             f"out tensor bfloat16 {[B, S, H, Dv]} ({GUIDE})")  # fmt: skip
    expect(name, "out", got.out, [B, S, H, Dv], (torch.bfloat16,), "bfloat16")
    if got.lse is not None:
        expect(name, "lse", got.lse, [B, S, H], (torch.float32, torch.float64), "an fp32")
    out = got.out.detach().cpu()
    if cap.inv_rope_freqs is not None and not plugin.spec.applies_inv_rope:  # as SGLang's model does after the kernel
        o = inverse_rope(out.reshape(B * S, H, Dv).float(), cap.inv_rope_freqs, cap.inv_rope_positions[: B * S])
        out = o.to(out.dtype).reshape(out.shape)
    lse = None if got.lse is None else got.lse.detach().cpu().float()
    return PathOutput(out, lse, plugin.where, dict(got.info))


def run_kernel(plugin: PluginBackend, cap: SparseCapture, opts: Optional[ReplayOptions] = None) -> tuple[PathOutput, SparseArithmetic]:
    """One call of a sparse kernel on ``cap``: its outputs and the arithmetic it is judged at."""
    arith = declared(plugin)
    device = device_of(opts or ReplayOptions())
    inputs = sparse_inputs(cap, device)
    fixes = interpreter_fixes()
    t0 = time.perf_counter()
    with torch.no_grad(), np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        got = plugin.fn(inputs)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    res = sparse_outputs(got, cap, plugin)
    if isinstance(got, KernelOutputs) and got.arithmetic is not None:
        arith = got.arithmetic
    res.info.update(kernel=plugin.where, layout="sparse_topk", kernel_seconds=round(time.perf_counter() - t0, 3),
                    device=str(device), **({"interpreter": fixes} if fixes else {}))  # fmt: skip
    return res, arith


class SparsePluginBackend(Backend):
    """A sparse top-k kernel outside refmla as a sparse capture's Backend (refmla.kinds.SparseKind)."""

    def __init__(self, name: str):
        self.name = name
        plugin = get_backend(name)
        if not getattr(plugin, "sparse", False):
            raise KeyError(f"{name} is not a sparse top-k kernel (refmla.kernel layout sparse_topk)")
        self.plugin: PluginBackend = plugin  # type: ignore[assignment]
        declared(self.plugin)  # a declaration that is not a SparseArithmetic: exit 2 before anything runs

    def availability(self) -> tuple[bool, str]:
        return self.plugin.availability()

    def run(self, cap: SparseCapture, opts=None) -> BackendResult:
        got, arith = run_kernel(self.plugin, cap, opts)
        return BackendResult(got.out, got.lse, info={"version": got.note, **got.info}, arithmetic=arith)


def sparse_path(name: str, cap: SparseCapture) -> PathOutput:
    """The sparse kernel ``name`` as a path function of refmla.sparse.backends (cap -> PathOutput),
    for the sweep and the sparse goldens; pickled by name (functools.partial of this)."""
    return run_kernel(SparsePluginBackend(name).plugin, cap)[0]


def arithmetic_of(name: str) -> SparseArithmetic:
    """The SparseArithmetic the sparse kernel ``name`` declares."""
    return declared(SparsePluginBackend(name).plugin)


__all__ = ["SparsePluginBackend", "arithmetic_of", "declared", "is_sparse_kernel", "run_kernel", "sparse_inputs",
           "sparse_outputs", "sparse_path"]  # fmt: skip
