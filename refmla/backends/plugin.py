"""A kernel outside refmla (refmla.kernel's interface) as a backend like refmla's own.

    capture --inputs_for (the layout the kernel declares)--> KernelInputs --fn--> KernelOutputs
            --outputs_of (shapes and dtypes checked)--> BackendResult

The replay, the goldens and the sweep run it through the same path as every other backend
(refmla.pipeline.run_backend: a child process, repeats, its declared arithmetic's control). A
kernel that raises, hangs or crashes is its ``error``; a callable that does not meet the
interface (its signature, what it returned) raises :class:`refmla.kernel.InterfaceError`, one
line naming what it gave against what was expected (the command line's exit 2).
"""

from __future__ import annotations

import inspect
import sys
import time
from typing import Any, Callable, Optional

import numpy as np
import torch

from refmla import blocktable
from refmla.backends import triton_interp
from refmla.backends.base import Backend, BackendResult, BackendUnavailable
from refmla.capture import Capture
from refmla.kernel import InterfaceError, KernelInputs, KernelOutputs, KernelSpec, spec_of
from refmla.options import ReplayOptions
from refmla.schedule import default_num_kv_splits, mla_max_kv_splits
from refmla.util import dtype_name

GUIDE = "docs/own-kernel.md"


def check_signature(fn: Any, name: str) -> None:
    """InterfaceError unless ``fn`` is a callable that takes one argument (the KernelInputs)."""
    if not callable(fn):
        raise InterfaceError(f"backend {name}: {type(fn).__name__} is not callable; expected fn(inputs: "
                             f"refmla.kernel.KernelInputs) ({GUIDE})")  # fmt: skip
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # a builtin without a signature: its call will say
    try:
        sig.bind(object())
    except TypeError:
        raise InterfaceError(f"backend {name}: {getattr(fn, '__name__', fn)}{sig} cannot be called with one argument; "
                             f"expected fn(inputs: refmla.kernel.KernelInputs) ({GUIDE})") from None  # fmt: skip


class PluginBackend(Backend):
    """The backend of one kernel callable, under ``name`` (what --backend said, or its entry point's name)."""

    modes = ("decode",)  # the capture modes it reads: its KernelSpec's (a layout it does not read is not read, not skipped)

    def __init__(self, name: str, fn: Callable, where: str):
        check_signature(fn, name)
        self.name, self.fn, self.where = name, fn, where
        self.spec: KernelSpec = spec_of(fn)
        self.fills_buffers = self.spec.writes_buffers
        self.modes = ("sparse_decode",) if self.sparse else tuple(self.spec.modes)

    @property
    def sparse(self) -> bool:
        """A sparse top-k kernel (refmla.sparse.kernel runs it on sparse captures)."""
        return self.spec.layout == "sparse_topk"

    def availability(self) -> tuple[bool, str]:
        if self.sparse:
            return True, f"{self.where} (sparse_topk)"
        verify = "" if self.spec.modes == ("decode",) else f", {' + '.join(self.spec.modes)}"
        return True, f"{self.where} ({self.spec.layout}, {self.spec.arithmetic.split_schedule} splits{verify})"

    def refuses(self, cap: Capture) -> Optional[str]:
        """Why this kernel reads no such capture (the mode, a tree mask it does not declare), or None."""
        if self.sparse:
            return "a sparse top-k kernel (layout sparse_topk): it reads sparse decode captures only"
        if cap.meta.mode not in self.spec.modes:
            return f"the kernel declares modes {', '.join(self.spec.modes)}; the capture is {cap.meta.mode} mode"
        if cap.is_verify and cap.custom_mask is not None and not self.spec.tree_mask:
            return "a tree verify (custom_mask): the kernel declares a causal verify only (tree_mask=False)"
        return None

    def run(self, cap: Capture, opts: ReplayOptions) -> BackendResult:
        why = self.refuses(cap)
        if why:
            raise BackendUnavailable(why)
        inputs, note = inputs_for(cap, opts, self.spec.layout)
        fixes = interpreter_fixes()
        t0 = time.perf_counter()
        with torch.no_grad(), np.errstate(divide="ignore", invalid="ignore", over="ignore"):  # the interpreter's masked lanes
            got = self.fn(inputs)
        if inputs.device.type == "cuda":
            torch.cuda.synchronize(inputs.device)
        res = outputs_of(got, inputs, self.spec, self.name)
        res.info.update(kernel=self.where, layout=self.spec.layout, layout_source=note,
                        kernel_seconds=round(time.perf_counter() - t0, 3), device=str(inputs.device))  # fmt: skip
        if fixes:
            res.info["interpreter"] = fixes
        return res


def interpreter_fixes() -> Optional[str]:
    """Under the Triton interpreter (a kernel that imported triton, on a CPU): refmla's fixes that
    make it round as compiled Triton does (refmla.backends.triton_interp: fp32 -> bf16 stores to
    nearest even, bf16 dots, fp8 casts), and what was installed; None elsewhere."""
    if "triton" not in sys.modules or not triton_interp.interpreter_active():
        return None
    ok, note = triton_interp.install_bf16_dot_fix()
    return note if ok else f"interpreter without refmla's rounding fixes: {note}"


def device_of(opts: ReplayOptions) -> torch.device:
    """``opts.device``, else a GPU where there is one, else the CPU (the Triton interpreter)."""
    if opts.device:
        return torch.device(opts.device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def splits_of(cap: Capture, opts: ReplayOptions) -> tuple[torch.Tensor, int]:
    """(num_kv_splits [B] int32, max_kv_splits): the capture's, else SGLang's get_num_kv_splits."""
    m = cap.meta
    if cap.num_kv_splits is not None:
        splits = cap.num_kv_splits.to(torch.int32)
        return splits, int(m.max_kv_splits or (int(splits.max()) if cap.batch_size else 1))
    max_kv = m.max_kv_splits or mla_max_kv_splits(opts.cu_count)
    splits = default_num_kv_splits(cap.seq_lens, max_kv_splits=max_kv, num_heads=cap.num_heads, cu_count=opts.cu_count)
    return splits.to(torch.int32), int(max_kv)


def inputs_for(cap: Capture, opts: ReplayOptions, layout: str) -> tuple[KernelInputs, str]:
    """The KernelInputs of a decode or verify capture in ``layout``, and where its index tensors came from."""
    dev, m = device_of(opts), cap.meta
    R, H, _ = cap.q.shape
    B = cap.batch_size
    Dv = int(m.kv_lora_rank)
    splits, S = splits_of(cap, opts)
    S = max(S, int(splits.max()) if B else 1, 1)
    fill = float("nan") if opts.buffer_fill is None else float(opts.buffer_fill)
    table = indptr = indices = None
    page_size = 1
    if layout == "block_table":
        if cap.block_table is not None and cap.is_decode:
            table, page_size, note = cap.block_table, int(m.page_size), "the capture's block_table"
        else:
            table, note = blocktable.from_token_rows(cap.kv_indptr, cap.kv_indices), "a page-size-1 table of the capture's token slots"
        table = table.to(dev, torch.int32).contiguous()
    else:
        indptr, indices = cap.kv_indptr.to(dev, torch.int32).contiguous(), cap.kv_indices.to(dev, torch.int64).contiguous()
        note = "the capture's token rows of its block_table" if cap.block_table is not None else "the capture's token slots"
    out_dtype = cap.out_dtype
    verify = cap.is_verify
    i32 = lambda t: None if t is None else t.to(dev, torch.int32).contiguous()  # noqa: E731
    tree = cap.mask_args() if verify else {"custom_mask": None, "mask_indptr": None}
    inputs = KernelInputs(
        layout=layout, q=cap.q.to(dev).contiguous(), kv_buffer=cap.kv_buffer.to(dev).contiguous(),
        seq_lens=cap.seq_lens.to(dev, torch.int32), kv_indptr=indptr, kv_indices=indices, block_table=table,
        page_size=page_size, num_kv_splits=splits.to(dev), max_kv_splits=S, kv_lora_rank=Dv,
        sm_scale=float(m.sm_scale), logit_cap=float(m.logit_cap), k_scale=float(m.k_scale), v_scale=float(m.v_scale),
        out=torch.full((R, H, Dv), fill, dtype=out_dtype, device=dev),
        lse=torch.full((R, H), fill, dtype=torch.float32, device=dev),
        attn_logits=torch.full((R, H, S, Dv), fill, dtype=torch.float32, device=dev),
        attn_lse=torch.full((R, H, S), fill, dtype=torch.float32, device=dev),
        mode=cap.meta.mode, qo_indptr=i32(cap.qo_indptr) if verify else None,
        custom_mask=None if tree["custom_mask"] is None else tree["custom_mask"].to(dev),
        mask_indptr=i32(tree["mask_indptr"]),
    )  # fmt: skip
    return inputs, note


def said(t: Any) -> str:
    """"bfloat16 [2, 16, 512]" for a tensor, its type's name for anything else."""
    if isinstance(t, torch.Tensor):
        return f"{dtype_name(t.dtype)} {list(t.shape)}"
    return "None" if t is None else type(t).__name__


def expect(name: str, what: str, got: Any, shape: list, dtypes: Optional[tuple] = None, want: str = "") -> None:
    """InterfaceError unless ``got`` is a tensor of ``shape`` (None: any size there) and one of ``dtypes``."""
    ok = isinstance(got, torch.Tensor) and got.dim() == len(shape)
    ok = ok and all(s is None or got.shape[i] == s for i, s in enumerate(shape))
    ok = ok and (dtypes is None or got.dtype in dtypes)
    if not ok:
        shown = "[" + ", ".join("S" if s is None else str(s) for s in shape) + "]"
        raise InterfaceError(f"backend {name} returned {what} {said(got)}; expected {want or 'a tensor'} {shown} "
                             f"(refmla.kernel.KernelOutputs, {GUIDE})")  # fmt: skip


FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
INTS = (torch.int32, torch.int64)


def outputs_of(got: Any, inputs: KernelInputs, spec: KernelSpec, name: str) -> BackendResult:
    """The BackendResult of what the kernel returned, each tensor's shape and dtype checked."""
    if isinstance(got, torch.Tensor):
        got = KernelOutputs(out=got)
    if not isinstance(got, KernelOutputs):
        raise InterfaceError(f"backend {name} returned {said(got)}; expected a refmla.kernel.KernelOutputs or the "
                             f"out tensor {dtype_name(inputs.out.dtype)} {list(inputs.out.shape)} ({GUIDE})")  # fmt: skip
    R, H, Dv = inputs.out.shape
    B = inputs.seq_lens.shape[0]
    expect(name, "out", got.out, [R, H, Dv], (inputs.out.dtype,), dtype_name(inputs.out.dtype))
    if got.lse is not None:
        expect(name, "lse", got.lse, [R, H], FLOATS, "a floating")
    if (got.attn_logits is None) != (got.attn_lse is None):
        raise InterfaceError(f"backend {name} returned attn_logits {said(got.attn_logits)} and attn_lse "
                             f"{said(got.attn_lse)}; expected both or neither ({GUIDE})")  # fmt: skip
    if got.attn_logits is not None:
        expect(name, "attn_logits", got.attn_logits, [R, H, None, Dv], FLOATS, "a floating")
        expect(name, "attn_lse", got.attn_lse, [R, H, got.attn_logits.shape[2]], FLOATS, "a floating")
    splits = got.num_kv_splits
    if splits is not None:
        expect(name, "num_kv_splits", splits, [B], INTS, "an int32 / int64")
    elif spec.arithmetic.split_schedule != "none":
        splits = inputs.num_kv_splits
    cpu = lambda t: None if t is None else t.detach().cpu()  # noqa: E731
    return BackendResult(
        out=cpu(got.out), lse=cpu(got.lse), attn_logits=cpu(got.attn_logits), attn_lse=cpu(got.attn_lse),
        num_kv_splits=None if splits is None else cpu(splits).to(torch.int32), info=dict(got.info),
        arithmetic=got.arithmetic or spec.arithmetic, defines_empty_rows=spec.defines_empty_rows,
    )  # fmt: skip


__all__ = ["GUIDE", "PluginBackend", "check_signature", "expect", "inputs_for", "outputs_of", "said"]
