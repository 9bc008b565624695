"""Running SGLang's Triton kernels on CPU: interpreter selection and the interpreter's bf16 dot fix.

Two facts about the Triton interpreter (``TRITON_INTERPRET=1``) shape this module.

1. It is chosen once per kernel, when ``@triton.jit`` decorates the function (``triton.runtime.jit``
   reads ``triton.knobs.runtime.interpret``, i.e. the environment variable, at decoration time and
   returns an ``InterpretedFunction`` instead of a ``JITFunction``). Triton's own helpers
   (``tl.cdiv`` ...) are decorated when ``triton`` is first imported and SGLang's kernels when
   their module is, and an interpreted kernel cannot call a compiled helper. So the variable must
   be set before the process first imports triton. :func:`ensure_interpreter` does that when there
   is no GPU, and says why it cannot when triton was already imported without it.

2. Its ``tl.dot`` is wrong for bf16. The interpreter stores bf16 tensors as their raw ``uint16``
   bit patterns (numpy has no bfloat16) and ``InterpreterBuilder.create_dot`` hands the operands
   straight to ``np.matmul``, which then multiplies the *integers* (fp8 operands get converted,
   bf16 do not): SGLang's MLA decode kernel returns values around 1e9 for bf16 inputs.
   :func:`install_bf16_dot_fix` wraps ``triton.runtime.interpreter.InterpreterBuilder.create_dot``
   (identical in triton 3.4.0 to 3.9.0) so that bf16 operands are widened to fp32 first. The
   widening is exact (bf16 is the top half of an fp32), each product of two bf16 values is exact in
   fp32, and the accumulator stays fp32, which is what the GPU's bf16 MMA with fp32 accumulation
   computes up to summation order. Everything else is passed through unchanged. The fix is applied
   only under the interpreter and never changes a compiled kernel.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Iterator, Optional

INTERPRET_ENV = "TRITON_INTERPRET"

# Where SGLang keeps the decode kernel: from 0.5.16 on, then up to 0.5.15.
KERNEL_MODULES = (
    "sglang.kernels.ops.attention.decode_attention",
    "sglang.srt.layers.attention.triton_ops.decode_attention",
)

_FIX_MARK = "_refmla_bf16_dot_fix"  # attribute set on our wrapper, so installing twice is a no-op
_original_create_dot = None  # the interpreter's own create_dot, kept to restore it


def gpu_present() -> bool:
    """True when torch sees a CUDA or ROCm device (Triton then compiles for it)."""
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False


def interpreter_active() -> bool:
    """Whether newly decorated ``@triton.jit`` functions will be interpreted (imports no triton)."""
    env = os.environ.get(INTERPRET_ENV, "0").lower() in ("1", "true", "on", "yes")
    if "triton" not in sys.modules:  # importing it here would decorate its helpers too early
        return env
    try:
        from triton import knobs

        return bool(knobs.runtime.interpret)
    except Exception:  # triton before knobs: the environment variable is the switch
        return env


def _loaded_kernel_module():
    for name in KERNEL_MODULES:
        mod = sys.modules.get(name)
        if mod is not None:
            return mod
    return None


def module_is_interpreted(mod) -> Optional[bool]:
    """True if ``mod``'s Triton kernels are interpreted, False if compiled, None if it has none."""
    try:
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import JITFunction
    except Exception:
        return None
    for value in vars(mod).values():
        if isinstance(value, InterpretedFunction):
            return True
        if isinstance(value, JITFunction):
            return False
    return None


def _loaded_triton_is_interpreted() -> Optional[bool]:
    """Whether the already imported ``triton.language`` decorated its own helpers (``tl.cdiv``,
    used inside SGLang's kernels) for the interpreter; None when triton is not imported yet."""
    std = sys.modules.get("triton.language.standard")
    if std is None:
        return None
    return module_is_interpreted(std)


def ensure_interpreter() -> tuple[bool, str]:
    """Select the Triton interpreter when there is no GPU, before anything is decorated.

    Triton decides per ``@triton.jit`` function, at decoration: its own ``triton.language``
    helpers when triton is first imported, SGLang's kernels when their module is imported. So
    this must run before the first ``import triton`` of the process (tests/conftest.py and the CLI
    call it first thing).

    Returns ``(interpreting, note)``: ``(True, ...)`` when kernels run in the interpreter,
    ``(False, "GPU present ...")`` when they will be compiled for a GPU, and ``(False, reason)`` when
    the interpreter is needed but triton or the kernel module was already imported without it
    (set ``TRITON_INTERPRET=1`` in the environment, or run in a fresh process). Never raises.
    """
    mod = _loaded_kernel_module()
    std = _loaded_triton_is_interpreted()
    if mod is not None or std is not None:
        interpreted = module_is_interpreted(mod) if mod is not None else std
        if interpreted and std is not False:
            return True, "interpreter (TRITON_INTERPRET=1)"
        if gpu_present():
            return False, "GPU present: compiled Triton kernels"
        what = mod.__name__ if mod is not None and not interpreted else "triton"
        return False, (
            f"{what} was imported before TRITON_INTERPRET=1 was set and there is no GPU; set "
            "TRITON_INTERPRET=1 before importing triton (or run in a fresh process)"
        )
    if interpreter_active():
        return True, "interpreter (TRITON_INTERPRET=1)"
    if gpu_present():
        return False, "GPU present: compiled Triton kernels"
    os.environ[INTERPRET_ENV] = "1"
    return True, "interpreter (TRITON_INTERPRET=1, set by refmla: no GPU)"


def _bf16_dot_target():
    """(InterpreterBuilder class, its create_dot) or raise RuntimeError naming what is missing."""
    try:
        import triton
        from triton.runtime import interpreter
    except Exception as exc:  # pragma: no cover - triton missing is reported by availability
        raise RuntimeError(f"triton interpreter not importable: {exc}") from exc
    builder = getattr(interpreter, "InterpreterBuilder", None)
    create_dot = getattr(builder, "create_dot", None) if builder is not None else None
    if create_dot is None or not hasattr(interpreter, "TensorHandle"):
        raise RuntimeError(
            f"triton {triton.__version__}: triton.runtime.interpreter.InterpreterBuilder.create_dot "
            "not found, so the interpreter's bf16 dot fix cannot be applied (bf16 results would be "
            "garbage); checked against triton 3.4.0-3.9.0"
        )
    return builder, create_dot


def _widen_bf16(handle):
    """A bf16 TensorHandle (uint16 bits) as an exact fp32 TensorHandle; others unchanged."""
    import numpy as np
    import triton.language as tl
    from triton.runtime.interpreter import TensorHandle

    if getattr(handle.dtype, "scalar", handle.dtype) != tl.bfloat16:
        return handle
    bits = np.asarray(handle.data).astype(np.uint32) << np.uint32(16)  # bf16 = top half of fp32
    return TensorHandle(bits.view(np.float32), tl.float32)


def _make_fixed_create_dot(original):
    def create_dot(self, a, b, d, *args, **kwargs):
        return original(self, _widen_bf16(a), _widen_bf16(b), d, *args, **kwargs)

    setattr(create_dot, _FIX_MARK, True)
    create_dot.__doc__ = "refmla: bf16 operands widened to fp32 before the interpreter's np.matmul."
    return create_dot


def bf16_dot_fix_installed() -> bool:
    try:
        _, create_dot = _bf16_dot_target()
    except RuntimeError:
        return False
    return bool(getattr(create_dot, _FIX_MARK, False))


def install_bf16_dot_fix() -> tuple[bool, str]:
    """Patch the interpreter's ``create_dot`` (idempotent). Only under the interpreter.

    Returns ``(installed, note)``; ``(False, reason)`` when not interpreting (nothing to fix) or when
    the internal it patches is missing in this triton (the caller must then refuse bf16 inputs).
    """
    global _original_create_dot
    if not interpreter_active():
        return False, "not under the Triton interpreter: no fix needed"
    try:
        builder, create_dot = _bf16_dot_target()
    except RuntimeError as exc:
        return False, str(exc)
    if not getattr(create_dot, _FIX_MARK, False):
        _original_create_dot = create_dot
        builder.create_dot = _make_fixed_create_dot(create_dot)
    return True, "interpreter (bf16 dot fix applied)"


def remove_bf16_dot_fix() -> None:
    """Restore the interpreter's own ``create_dot`` (used by the test that shows the bug)."""
    try:
        builder, create_dot = _bf16_dot_target()
    except RuntimeError:
        return
    if getattr(create_dot, _FIX_MARK, False) and _original_create_dot is not None:
        builder.create_dot = _original_create_dot


@contextlib.contextmanager
def bf16_dot_fix(enabled: bool = True) -> Iterator[None]:
    """Within the block the fix is installed (``enabled``) or removed; afterwards as it was."""
    was = bf16_dot_fix_installed()
    if enabled:
        ok, note = install_bf16_dot_fix()
        if not ok and interpreter_active():
            raise RuntimeError(note)
    else:
        remove_bf16_dot_fix()
    try:
        yield
    finally:
        if was:
            install_bf16_dot_fix()
        else:
            remove_bf16_dot_fix()
