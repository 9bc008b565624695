"""The ``extend`` backend: runs the local extend both ways, reports the primary, judges the others."""

from __future__ import annotations

import math
import os
import time
from typing import Any, Optional

import torch

from refmla.arithmetic import SGLANG_EXTEND, UNSPLIT, Arithmetic
from refmla.backends import aiter as aiter_backend
from refmla.backends import triton_interp
from refmla.backends.base import Backend, BackendResult, BackendUnavailable
from refmla.backends.extend.aiter_prefill import run_aiter_prefill
from refmla.backends.extend.inputs import ExtendInputs, as_extend, scatter_rows
from refmla.backends.extend.local import mla_extend_local
from refmla.backends.extend.sglang_triton import run_triton_extend, triton_extend_status
from refmla.backends.reference import reference_output
from refmla.capture import Capture
from refmla.compare import Comparison, compare
from refmla.control import capture_control
from refmla.options import ReplayOptions
from refmla.util import error_text

IMPL_ENV = "REFMLA_EXTEND_IMPL"

Triton = tuple[torch.Tensor, Optional[torch.Tensor], dict]  # run_triton_extend's out, lse, info


def _chosen_impl(opts: ReplayOptions) -> str:
    impl = (opts.extend_impl or os.environ.get(IMPL_ENV) or "auto").lower()
    if impl not in ("auto", "torch", "triton"):
        raise BackendUnavailable(f"{IMPL_ENV}={impl!r}: choose auto, torch or triton")
    return impl


def summarize(cmp: Comparison) -> dict:
    """A secondary implementation's comparison, as a small JSON dict."""
    d = {"status": "pass" if cmp.passed else "fail", "max_abs_err": cmp.max_abs_err, "cos_diff": cmp.cos_diff,
         "worst": {"request": cmp.worst.request, "head": cmp.worst.head}}  # fmt: skip
    if not cmp.passed:
        d["reason"] = "; ".join(cmp.reasons)
    return d


class _Judge:
    """Judges a secondary implementation's output (summarized); the reference and the control it
    needs are computed once, and only if something is judged."""

    def __init__(self, cap, out_dtype: torch.dtype, tol):
        self.cap, self.out_dtype = cap, out_dtype
        self.kw = {"tol": tol} if tol is not None else {}
        self.expected: Optional[torch.Tensor] = None
        self.controls: dict[Arithmetic, torch.Tensor] = {}

    def __call__(self, name: str, out: torch.Tensor, arith: Arithmetic = UNSPLIT) -> dict:
        """``out`` against the reference within the control of the arithmetic it declares (refmla.arithmetic)."""
        cap = self.cap
        if self.expected is None:
            self.expected = reference_output(cap)[0]
        if arith not in self.controls:
            self.controls[arith] = capture_control(cap, self.out_dtype, arith=arith)[0]  # unsplit
        expected, control = self.expected, self.controls[arith]
        rows = cap.request_of_row()
        cmp = compare(name, out, expected, control, out_dtype=self.out_dtype, request_of_row=rows, **self.kw)
        return summarize(cmp)


def _try_triton(impl: str, cap, inp: ExtendInputs, out_dtype: torch.dtype, opts: ReplayOptions) -> tuple[Optional[Triton], dict]:
    """SGLang's Triton extend unless ``impl`` is torch: (its result or None, the entry saying why not)."""
    if impl == "torch":
        return None, {"status": "skipped", "reason": f"{IMPL_ENV}=torch"}
    ok, note = triton_extend_status()
    if ok and triton_interp.interpreter_active():
        why = triton_interp.over_budget(cap)
        ok, note = (False, why) if why else (ok, note)
    if not ok:
        if impl == "triton":
            raise BackendUnavailable(f"SGLang Triton extend: {note}")
        return None, {"status": "skipped", "reason": note}
    try:
        device = opts.device
        return run_triton_extend(inp, cap.kv_buffer, cap.scales(), out_dtype, device), {}
    except Exception as e:
        if impl == "triton":
            raise
        return None, {"status": "error", "reason": error_text(e)}


def _aiter_prefill(cap: Capture, inp: ExtendInputs, out_dtype: torch.dtype, opts: ReplayOptions, judge: _Judge) -> dict:
    """aiter's prefill judged against the reference, or why it did not run."""
    ok, why = aiter_backend.aiter_status()
    if not ok:
        return {"status": "skipped", "reason": why}
    try:
        o, info = run_aiter_prefill(cap, inp, out_dtype, opts.device)
    except Exception as e:
        return {"status": "error", "reason": error_text(e)}
    return {**judge("aiter_prefill", scatter_rows(o, inp)), **info}


class ExtendBackend(Backend):
    name = "extend"

    def availability(self) -> tuple[bool, str]:
        ok, note = triton_extend_status()
        if ok:
            return True, f"local extend: {note}; pure PyTorch alongside"
        return True, f"local extend: pure PyTorch {torch.__version__} (SGLang Triton extend unavailable: {note})"

    def run(self, cap: Capture, opts: ReplayOptions) -> BackendResult:
        impl = _chosen_impl(opts)
        out_dtype = cap.out_dtype
        inp = as_extend(cap)
        t0 = time.perf_counter()
        t_out, t_lse = mla_extend_local(inp, cap.kv_buffer, cap.scales(), out_dtype)
        torch_s = round(time.perf_counter() - t0, 3)
        tri, tri_entry = _try_triton(impl, cap, inp, out_dtype, opts)
        judge = _Judge(cap, out_dtype, opts.tol)

        info: dict[str, Any] = {
            "prefix": "positions 0..L-n-1 through kv_indptr/kv_indices",
            "new_tokens": "positions L-n..L-1 as k_extend/v_extend (dequantized cache rows), causal bottom-right",
            "new_tokens_per_request": "1 (decode step as a one-token extend)" if cap.is_decode else "qo_indptr",
        }
        if inp.custom_mask is not None:
            info["custom_mask"] = inp.mask_source
        torch_full = scatter_rows(t_out, inp)
        if tri is not None:
            o, lse, tinfo = tri
            out, out_lse = scatter_rows(o, inp), (scatter_rows(lse, inp, -math.inf) if lse is not None else None)
            info["implementation"] = "sglang_triton"
            info["triton"] = tinfo
            info["torch_extend"] = {**judge("torch_extend", torch_full, SGLANG_EXTEND), "seconds": torch_s}
        else:
            out, out_lse = torch_full, scatter_rows(t_lse, inp, -math.inf)
            info["implementation"] = "torch"
            info["sglang_triton_extend"] = tri_entry
        info["aiter_prefill"] = _aiter_prefill(cap, inp, out_dtype, opts, judge)
        return BackendResult(out=out, lse=out_lse, info=info, defines_empty_rows=True,
                             arithmetic=SGLANG_EXTEND)  # one pass; q rounded whole against the fp8 prefix only


__all__ = ["IMPL_ENV", "ExtendBackend", "summarize"]
