"""Importing vLLM's Triton kernels on a CPU-only machine, for the Triton interpreter.

``vllm.triton_utils`` decides once, at import, whether Triton is usable (``HAS_TRITON``): it
counts Triton's active GPU drivers and wants exactly one, else replaces ``triton`` / ``tl`` by
placeholders whose ``@triton.jit`` leaves plain Python functions, which cannot be launched. On a
CPU-only machine no driver is active, so without help vLLM's kernels never run there, even under
``TRITON_INTERPRET=1``. vLLM itself accepts zero drivers when the visible-devices variable is set
but empty (its "distributed environment" case), so :func:`vllm_triton_on_cpu` sets
``CUDA_VISIBLE_DEVICES=""`` around that one import, and only where there is no GPU, the
interpreter is selected and the variable is unset; it is restored right after.
"""

from __future__ import annotations

import os
import sys

from refmla.backends import triton_interp

_VAR = "CUDA_VISIBLE_DEVICES"


def vllm_triton_on_cpu() -> tuple[bool, str]:
    """(vLLM sees Triton, note). Imports ``vllm.triton_utils`` the way that lets it see the
    interpreter on a CPU-only machine; never raises."""
    interp, how = triton_interp.ensure_interpreter()
    if "vllm.triton_utils" in sys.modules:
        return _has_triton(), "vllm.triton_utils imported earlier"
    patch = interp and not triton_interp.gpu_present() and _VAR not in os.environ
    if patch:
        os.environ[_VAR] = ""
    try:
        import vllm.triton_utils  # noqa: F401
    except Exception as e:
        return False, f"vllm.triton_utils not importable: {type(e).__name__}: {e}"
    finally:
        if patch:
            os.environ.pop(_VAR, None)
    return _has_triton(), ("interpreter: zero GPU drivers accepted" if patch else how)


def _has_triton() -> bool:
    mod = sys.modules.get("vllm.triton_utils.importing")
    return bool(getattr(mod, "HAS_TRITON", False))


__all__ = ["vllm_triton_on_cpu"]
