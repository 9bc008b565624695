"""Running SGLang's Triton kernels on CPU: interpreter selection and a fix for its bf16 arithmetic.

Two facts about the Triton interpreter (``TRITON_INTERPRET=1``) shape this module.

1. It is chosen once per kernel, when ``@triton.jit`` decorates the function (``triton.runtime.jit``
   reads ``triton.knobs.runtime.interpret``, i.e. the environment variable, at decoration time and
   returns an ``InterpretedFunction`` instead of a ``JITFunction``). Triton's own helpers
   (``tl.cdiv`` ...) are decorated when ``triton`` is first imported and SGLang's kernels when
   their module is, and an interpreted kernel cannot call a compiled helper. So the variable must
   be set before the process first imports triton. :func:`ensure_interpreter` does that when there
   is no GPU, and says why it cannot when triton was already imported without it.

2. Its low-precision arithmetic is wrong in four places, all in ``triton.runtime.interpreter.InterpreterBuilder``
   (identical in triton 3.4.0 to 3.9.0). The interpreter stores bf16 tensors as their raw
   ``uint16`` bit patterns (numpy has no bfloat16), and

   * ``create_dot`` hands those to ``np.matmul``, which multiplies the *integers* (fp8 operands get
     converted, bf16 do not): SGLang's MLA decode kernel returns values around 1e9 for bf16 inputs;
   * ``cast_impl`` converts fp32 -> bf16 by dropping the low 16 bits (round toward zero), where
     compiled Triton rounds to nearest even (``tl.cast``'s default, the ``fptrunc`` it emits). The
     kernel's ``p.to(v.dtype)`` and its bf16 output store go through it; truncation biases every
     output element toward zero, about five times the control's cosine difference.

   * ``create_fp_to_fp`` (fp32 / bf16 -> fp8, used for an fp8 KV cache: ``q.to(K_Buffer.dtype)``,
     ``p.to(v.dtype)``) rounds the mantissa up without carrying into the exponent, so 1.94 becomes
     1.0 instead of 2.0;
   * ``binary_op`` (bf16 ``*``, ``+``, ``-``, ``/``, min / max) computes on the uint16 bit patterns:
     SGLang's DeepSeek-V4 Triton sparse kernel dequantizes as ``fp8.to(bf16) * scale_bf16`` and
     returned values around 1e34; it is computed in fp32 and rounded to nearest even instead.

   :func:`install_bf16_dot_fix` wraps all four: bf16 dot operands are widened to fp32 first
   (exact: bf16 is the top half of an fp32, each product of two bf16 values is exact in fp32, and
   the accumulator stays fp32, as the GPU's bf16 MMA with fp32 accumulation computes up to
   summation order); fp32 -> bf16 casts round to nearest even; fp -> fp8 casts round to nearest
   even through torch, saturating like the GPUs' ``satfinite`` conversions. Everything else is
   passed through unchanged. The fix is applied only under the interpreter and never touches a
   compiled kernel. Checked with SGLang's kernel on triton 3.4.0, 3.5.1, 3.6.0 (their
   interpreters need numpy < 2: they call int() on one-element arrays), 3.7.1, 3.8.0 and 3.9.0.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Iterable, Iterator, Optional

INTERPRET_ENV = "TRITON_INTERPRET"

# Where SGLang keeps the decode kernel: from 0.5.16 on, then up to 0.5.15.
KERNEL_MODULES = (
    "sglang.kernels.ops.attention.decode_attention",
    "sglang.srt.layers.attention.triton_ops.decode_attention",
)

_FIX_MARK = "_refmla_bf16_dot_fix"  # attribute set on our wrappers, so installing twice is a no-op


def gpu_present() -> bool:
    """True when torch sees a CUDA or ROCm device (Triton then compiles for it)."""
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False


# The Triton interpreter runs each program in numpy, ~0.7 ms per (query row, head, attended row) on
# a loaded 2-core machine (measured: 2 heads x 131,072 tokens took 189 s): past this many the
# interpreted kernels are skipped with the reason (the reference and the torch paths still judge
# the capture); REFMLA_INTERPRETER_BUDGET overrides it.
INTERPRETER_BUDGET = 1 << 17
BUDGET_ENV = "REFMLA_INTERPRETER_BUDGET"


def interpreter_work(cap) -> int:
    """query rows x heads x rows each attends: decode H * nnz; extend / verify H * sum_b n_b * L_b."""
    H, seq = cap.num_heads, cap.seq_lens.long()
    if cap.is_decode or cap.qo_indptr is None:
        return H * int(seq.sum())
    n = (cap.qo_indptr[1:] - cap.qo_indptr[:-1]).long()
    return H * int((n * (seq + n)).sum())


def over_budget(cap) -> Optional[str]:
    """Why an interpreted kernel is not run on ``cap`` (its work past the budget), or None."""
    try:
        budget = int(os.environ.get(BUDGET_ENV, INTERPRETER_BUDGET))
    except ValueError:
        budget = INTERPRETER_BUDGET
    work = interpreter_work(cap)
    if work <= budget:
        return None
    return (f"the Triton interpreter would walk {work:,} (row, head, attended row) triples, past its budget "
            f"{budget:,} ({BUDGET_ENV}); replay on a GPU")  # fmt: skip


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

    It also makes a CUDA-built torchvision importable next to a CPU torch (a no-op elsewhere;
    see :mod:`refmla.backends.cpu_compat`): SGLang imports torchvision, and a failed import there
    would make every SGLang kernel unavailable for the rest of the process.
    """
    try:
        from refmla.backends.cpu_compat import torchvision_cpu_shim

        torchvision_cpu_shim()
    except Exception:  # never fatal: at worst SGLang's import reports the problem itself
        pass
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


# (method of triton.runtime.interpreter.InterpreterBuilder, what goes wrong without the fix)
_PATCHED = {
    "create_dot": "tl.dot multiplies bf16 operands as their raw uint16 bits",
    "cast_impl": "fp32 -> bf16 casts and stores truncate instead of rounding to nearest even",
    "create_fp_to_fp": "rounding up into the next binade drops the carry in fp -> fp8 casts (1.94 -> 1.0)",
    "binary_op": "bf16 elementwise arithmetic (x * scale, a + b) operates on the raw uint16 bits",
}

# triton fp8 type name -> torch dtype name (GPU conversions round to nearest even, saturating)
_FP8 = {
    "fp8e4nv": "float8_e4m3fn", "fp8e5": "float8_e5m2",
    "fp8e4b8": "float8_e4m3fnuz", "fp8e5b16": "float8_e5m2fnuz",
}  # fmt: skip
_originals: dict = {}  # name -> the interpreter's own method, kept to restore it
_suppressed: set = set()  # parts a bf16_dot_fix(enabled=False) block keeps off (tests only)


def _bf16_targets() -> tuple[type, dict]:
    """(InterpreterBuilder, {name: method}) or raise RuntimeError naming what is missing."""
    try:
        import triton
        from triton.runtime import interpreter
    except Exception as exc:  # pragma: no cover - triton missing is reported by availability
        raise RuntimeError(f"triton interpreter not importable: {exc}") from exc
    builder = getattr(interpreter, "InterpreterBuilder", None)
    methods = {name: getattr(builder, name, None) for name in _PATCHED} if builder else {}
    missing = [n for n in _PATCHED if methods.get(n) is None]
    if builder is None or missing or not hasattr(interpreter, "TensorHandle"):
        what = ", ".join(missing) or "InterpreterBuilder / TensorHandle"
        raise RuntimeError(
            f"triton {triton.__version__}: triton.runtime.interpreter.InterpreterBuilder {what} not "
            "found, so refmla's bf16 fix for the interpreter cannot be applied (bf16 results would be "
            "wrong); it was checked against triton 3.4.0 to 3.9.0"
        )
    return builder, methods


def _widen_bf16(handle):
    """A bf16 TensorHandle (uint16 bits) as an exact fp32 TensorHandle; others unchanged."""
    import numpy as np
    import triton.language as tl
    from triton.runtime.interpreter import TensorHandle

    if getattr(handle.dtype, "scalar", handle.dtype) != tl.bfloat16:
        return handle
    bits = np.asarray(handle.data).astype(np.uint32) << np.uint32(16)  # bf16 = top half of fp32
    return TensorHandle(bits.view(np.float32), tl.float32)


def f32_to_bf16_bits(data):
    """fp32 numpy array -> bf16 bit patterns (uint16), round to nearest even, NaN -> 0x7FC0.

    The same rounding as ``torch.Tensor.to(torch.bfloat16)`` and the GPUs' fp32 -> bf16 convert.
    """
    import numpy as np

    f = np.asarray(data, dtype=np.float32)
    bits = f.view(np.uint32).astype(np.uint64)
    rounded = (bits + np.uint64(0x7FFF) + ((bits >> np.uint64(16)) & np.uint64(1))) >> np.uint64(16)
    return np.where(np.isnan(f), np.uint64(0x7FC0), rounded).astype(np.uint16)


def _to_fp8_bits(handle, torch_name: str):
    """An fp32 / fp16 / bf16 TensorHandle as fp8 bit patterns (uint8): round to nearest even,
    finite overflow and infinities saturate to the largest finite value (the GPUs' satfinite)."""
    import numpy as np
    import torch

    f32 = _widen_bf16(handle).data.astype(np.float32)
    dtype = getattr(torch, torch_name)
    big = torch.finfo(dtype).max
    x = torch.from_numpy(np.ascontiguousarray(f32))
    x = torch.where(torch.isnan(x), x, x.clamp(-big, big))
    return x.to(dtype).view(torch.uint8).numpy()


def _make_fixed(name: str, original):
    import triton.language as tl
    from triton.runtime.interpreter import TensorHandle

    if name == "create_fp_to_fp":
        from triton.runtime import interpreter

        rtne = getattr(getattr(interpreter, "_ir", None), "ROUNDING_MODE", None)
        rtne = getattr(rtne, "RTNE", None)

        def fixed(self, src, dst_type, rounding_mode, *args, **kwargs):
            fp8 = _FP8.get(dst_type.scalar.name)
            if fp8 is not None and rounding_mode == rtne and src.dtype.scalar.primitive_bitwidth > 8:
                return TensorHandle(_to_fp8_bits(src, fp8), dst_type.scalar)
            return original(self, src, dst_type, rounding_mode, *args, **kwargs)

        fixed.__doc__ = "refmla: fp -> fp8 rounded to nearest even (saturating) by torch, with the carry."
    elif name == "binary_op":
        import numpy as np

        arithmetic = {np.add, np.subtract, np.multiply, np.divide, np.fmod, np.minimum, np.maximum, np.fmin, np.fmax}

        def fixed(self, lhs, rhs, op, *args, **kwargs):
            bf16 = tl.bfloat16
            if op in arithmetic and lhs.dtype.scalar == bf16 and rhs.dtype.scalar == bf16:
                wide = original(self, _widen_bf16(lhs), _widen_bf16(rhs), op, *args, **kwargs)
                return TensorHandle(f32_to_bf16_bits(wide.data), bf16)
            return original(self, lhs, rhs, op, *args, **kwargs)

        fixed.__doc__ = "refmla: bf16 arithmetic in fp32, rounded to nearest even, as compiled Triton does."
    elif name == "create_dot":

        def fixed(self, a, b, d, *args, **kwargs):
            return original(self, _widen_bf16(a), _widen_bf16(b), d, *args, **kwargs)

        fixed.__doc__ = "refmla: bf16 dot operands widened (exactly) to fp32 before the interpreter's np.matmul."
    else:

        def fixed(self, src, dst_type, *args, **kwargs):
            if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
                return TensorHandle(f32_to_bf16_bits(src.data), tl.bfloat16)
            return original(self, src, dst_type, *args, **kwargs)

        fixed.__doc__ = "refmla: fp32 -> bf16 rounded to nearest even, as compiled Triton does."
    setattr(fixed, _FIX_MARK, True)
    return fixed


def triton_ready() -> tuple[bool, str]:
    """(usable, note): triton imports and its kernels can run here (the interpreter chosen before
    the first import, or a GPU); the note says how, or why not."""
    interp, how = ensure_interpreter()  # before the first import of triton
    try:
        import triton  # noqa: F401
    except Exception as e:
        return False, f"triton not importable: {type(e).__name__}: {e}"
    if not interp and not gpu_present():
        return False, how
    return True, how


def where_kernel_runs(module) -> tuple[bool, str]:
    """(runnable, where) for a located Triton kernel module: the interpreter (with the bf16 fix
    installed), a GPU, or neither (compiled with no GPU: the reason)."""
    if module_is_interpreted(module):
        ok, note = install_bf16_dot_fix()
        return (True, "interpreter (bf16 dot fix applied)") if ok else (False, note)
    if gpu_present():
        import torch

        return True, f"compiled on {torch.cuda.get_device_name(0)}"
    return False, f"{module.__name__} was imported compiled and there is no GPU; set TRITON_INTERPRET=1"


def bf16_dot_fix_installed() -> bool:
    try:
        _, methods = _bf16_targets()
    except RuntimeError:
        return False
    return all(getattr(m, _FIX_MARK, False) for m in methods.values())


def install_bf16_dot_fix(parts: Optional[Iterable[str]] = None) -> tuple[bool, str]:
    """Patch the interpreter's bf16 handling (idempotent). Only under the interpreter.

    Three methods of ``triton.runtime.interpreter.InterpreterBuilder`` are wrapped:
    ``create_dot`` (bf16 operands widened to fp32), ``cast_impl`` (fp32 -> bf16 rounded to
    nearest even, where the interpreter truncates; this rounds the kernel's ``p.to(v.dtype)`` and
    its bf16 output store) and ``create_fp_to_fp`` (fp -> fp8 with the rounding carry, for an
    fp8 KV cache). ``parts`` picks a subset of those names (tests only). Returns
    ``(installed, note)``; ``(False, reason)`` when not interpreting (nothing to fix) or when this
    triton lacks what is patched (the caller must then refuse bf16 inputs).
    """
    if not interpreter_active():
        return False, "not under the Triton interpreter: no fix needed"
    try:
        builder, methods = _bf16_targets()
    except RuntimeError as exc:
        return False, str(exc)
    for name, method in methods.items():
        if (parts is None or name in parts) and name not in _suppressed and not getattr(method, _FIX_MARK, False):
            _originals[name] = method
            setattr(builder, name, _make_fixed(name, method))
    if _suppressed:
        return True, f"interpreter (bf16 dot fix suppressed for {', '.join(sorted(_suppressed))}: tests only)"
    return True, "interpreter (bf16 dot fix applied)"


def remove_bf16_dot_fix(parts: Optional[Iterable[str]] = None) -> None:
    """Restore the interpreter's own methods (used by the tests that show the bugs)."""
    try:
        builder, methods = _bf16_targets()
    except RuntimeError:
        return
    for name, method in methods.items():
        if (parts is None or name in parts) and getattr(method, _FIX_MARK, False) and name in _originals:
            setattr(builder, name, _originals[name])


@contextlib.contextmanager
def bf16_dot_fix(enabled: bool = True, parts: Optional[Iterable[str]] = None) -> Iterator[None]:
    """Within the block the fix (or ``parts`` of it) is installed (``enabled``) or removed;
    afterwards every part is as it was."""
    _, methods = _bf16_targets()
    was = {name: bool(getattr(m, _FIX_MARK, False)) for name, m in methods.items()}
    was_suppressed = set(_suppressed)
    chosen = set(_PATCHED if parts is None else parts)
    if enabled:
        _suppressed.difference_update(chosen)
        ok, note = install_bf16_dot_fix(chosen)
        if not ok and interpreter_active():
            raise RuntimeError(note)
    else:
        remove_bf16_dot_fix(chosen)
        _suppressed.update(chosen)  # so a runner's own install_bf16_dot_fix() leaves them off
    try:
        yield
    finally:
        _suppressed.clear()
        _suppressed.update(was_suppressed)
        remove_bf16_dot_fix([n for n, on in was.items() if not on])
        _suppressed_now = set(_suppressed)
        _suppressed.clear()
        install_bf16_dot_fix([n for n, on in was.items() if on])
        _suppressed.update(_suppressed_now)
