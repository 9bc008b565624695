"""The merge kernels that replay a merge capture, by name, each run on the documented pieces (an
empty piece's lse -inf) in the base its code documents (natural log for both; a log2 capture's lse
is converted before and after):

    vllm_triton_merge    vLLM's ``merge_attn_states`` Triton kernel (lse [H, T]), interpreted on a CPU
    sglang_triton_merge  SGLang's ``merge_state_triton`` (lse [T, H]), interpreted on a CPU

A backend that cannot be imported raises :class:`Unavailable` (the entry is ``skipped`` with why).
"""

from __future__ import annotations

from typing import Callable

import torch

from refmla.backends.triton_interp import ensure_interpreter, install_bf16_dot_fix, interpreter_active
from refmla.backends.vllm_compat import vllm_triton_on_cpu
from refmla.merge.format import MergeCapture
from refmla.merge.reference import LN2, documented


class Unavailable(RuntimeError):
    """The kernel cannot run here; the message says why."""


def _natural(cap: MergeCapture) -> tuple[torch.Tensor, ...]:
    p = documented(cap)
    unit = LN2 if p.base == "2" else 1.0
    return p.out_a.contiguous(), (p.lse_a.float() * unit).contiguous(), p.out_b.contiguous(), (p.lse_b.float() * unit).contiguous()


def _interpreting(cap: MergeCapture) -> None:
    """The Triton interpreter selected (unless a GPU runs the kernels), and for bf16 refmla's fix of
    its fp32 -> bf16 cast (the interpreter truncates where GPUs round to nearest even)."""
    ok, note = ensure_interpreter()
    if not ok and "GPU" not in note:
        raise Unavailable(note)
    if interpreter_active() and torch.bfloat16 in (cap.out.dtype, cap.out_a.dtype):
        fixed, why = install_bf16_dot_fix()
        if not fixed:
            raise Unavailable(why)


def vllm_triton_merge(cap: MergeCapture) -> tuple[torch.Tensor, torch.Tensor]:
    ok, why = vllm_triton_on_cpu()
    if not ok:
        raise Unavailable(why)
    _interpreting(cap)
    try:
        from vllm.v1.attention.ops.triton_merge_attn_states import merge_attn_states
    except Exception as e:
        raise Unavailable(f"vllm.v1.attention.ops.triton_merge_attn_states: {type(e).__name__}: {e}") from e
    oa, la, ob, lb = _natural(cap)
    out = torch.empty_like(cap.out)
    lse = torch.empty(la.shape[1], la.shape[0], dtype=torch.float32)  # [H, T]
    merge_attn_states(out, oa, la.t(), ob, lb.t(), output_lse=lse)
    unit = LN2 if cap.meta.lse_base == "2" else 1.0
    return out, lse.t() / unit


def sglang_triton_merge(cap: MergeCapture) -> tuple[torch.Tensor, torch.Tensor]:
    _interpreting(cap)
    try:
        from sglang.kernels.ops.attention.merge_state import merge_state_triton
    except Exception as e:
        raise Unavailable(f"sglang.kernels.ops.attention.merge_state: {type(e).__name__}: {e}") from e
    oa, la, ob, lb = _natural(cap)
    out, lse = merge_state_triton(oa, la, ob, lb)
    unit = LN2 if cap.meta.lse_base == "2" else 1.0
    return out, lse / unit


BACKENDS: dict[str, Callable[[MergeCapture], tuple[torch.Tensor, torch.Tensor]]] = {
    "vllm_triton_merge": vllm_triton_merge, "sglang_triton_merge": sglang_triton_merge,
}  # fmt: skip
KERNELS = {"vllm_triton_merge": ("vllm", "vllm.v1.attention.ops.triton_merge_attn_states", "merge_attn_states"),
           "sglang_triton_merge": ("sglang", "sglang.kernels.ops.attention.merge_state", "merge_state_triton")}  # fmt: skip


def availability(name: str) -> tuple[bool, str]:
    """(usable, what runs or why not) for the merge kernel ``name`` (`refmla doctor`); never raises."""
    _, module, fn = KERNELS[name]
    ok, note = ensure_interpreter()
    if not ok and "GPU" not in note:
        return False, note
    if name == "vllm_triton_merge":
        seen, why = vllm_triton_on_cpu()
        if not seen:
            return False, why
    try:
        getattr(__import__(module, fromlist=[fn]), fn)
    except Exception as e:
        return False, f"{module}.{fn}: {type(e).__name__}: {e}"
    return True, f"{module}.{fn}" + (" (interpreter)" if interpreter_active() else "")


__all__ = ["BACKENDS", "KERNELS", "Unavailable", "availability"]
