"""The ``triton`` backend: SGLang's own Triton MLA decode kernel, run on the captured inputs.

The kernel (``decode_attention_fwd``, grouped path, ``has_mla=True``, Lk = 576, Lv = 512) is
imported from the installed SGLang and called as is, never re-written:

    stage 1  grid (B, head tiles, S): split s of request b attends positions
             [s * per, min((s + 1) * per, L_b)), per = ceil(ceil(L_b / n_b) / 32) * 32,
             and stores its normalized partial acc / e_sum  -> attn_logits [B, H, S, Dv] fp32
             and lse = e_max + log(e_sum)                    -> attn_lse    [B, H, S]     fp32
             (no v_scale in the partials; empty splits leave both buffers untouched)
    stage 2  merges splits 0 .. S-1 that are non-empty, writes acc / e_sum * v_scale -> o

Where it lives: ``sglang.kernels.ops.attention.decode_attention`` from SGLang 0.5.16,
``sglang.srt.layers.attention.triton_ops.decode_attention`` before. Its signature grew over
releases, so the call is built by keyword from ``inspect.signature``.

Trimming. Splits at or beyond ``ceil(L_b / per_b)`` are empty for every request, so stage 1
returns at once for them and stage 2 skips them. Sizing the buffers (and so the stage-1 grid and
the stage-2 loop) to the largest number of non-empty splits instead of the production
``max_kv_splits`` cannot change a bit of the result, while the interpreter no longer walks the
empty programs. ``tests/test_triton_backend.py`` proves the bit-for-bit claim.

On a CPU-only machine the kernel runs in the Triton interpreter, with refmla's fix for the
interpreter's bf16 ``tl.dot`` (see :mod:`refmla.backends.triton_interp`).
"""

from __future__ import annotations

import importlib
import inspect
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch

from refmla.arithmetic import SGLANG_TRITON
from refmla.backends import triton_interp
from refmla.backends.base import Backend, BackendResult, BackendUnavailable
from refmla.backends.calling import (KernelNotFound, KernelSignatureError, find_function, kwargs_for, positional_for,
                                    unreadable_signature)
from refmla.capture import Capture
from refmla.options import ReplayOptions
from refmla.scales import Scales
from refmla.schedule import (MIN_BLOCK_KV, default_num_kv_splits, mla_max_kv_splits, nonempty_splits_batch,
                             sglang_block_n)

# --------------------------------------------------------------------------------------------
# Finding the kernel
# --------------------------------------------------------------------------------------------

_located: Optional[tuple[Callable, str, str]] = None


def sglang_version() -> str:
    try:
        from importlib.metadata import version

        return version("sglang")
    except Exception:
        try:
            import sglang

            return str(getattr(sglang, "__version__", "unknown"))
        except Exception:
            return "unknown"


def locate_decode_kernel() -> tuple[Callable, str, str]:
    """(decode_attention_fwd, its module path, sglang version), new path first, then the old one.

    Selects the Triton interpreter first when there is no GPU (it must precede the import).
    Raises KernelNotFound with what went wrong at each path.
    """
    global _located
    if _located is not None:
        return _located
    triton_interp.ensure_interpreter()
    fn, name = find_function(triton_interp.KERNEL_MODULES, "decode_attention_fwd", "SGLang's Triton decode kernel")
    _located = (fn, name, sglang_version())
    return _located


def _kernel_module(module_path: str):
    return importlib.import_module(module_path)


# --------------------------------------------------------------------------------------------
# The plain-tensor runner
# --------------------------------------------------------------------------------------------

# Parameters of decode_attention_fwd that refmla fills; any other one without a default is an
# interface this refmla does not know, and the call is refused rather than guessed.
_KNOWN = (
    "q", "k_buffer", "v_buffer", "o", "kv_indptr", "kv_indices", "attn_logits", "attn_lse",
    "num_kv_splits", "max_kv_splits", "sm_scale", "k_scale", "v_scale", "logit_cap", "has_mla",
    "page_size",
)  # fmt: skip


# decode_attention_fwd's documented parameter order (SGLang 0.4.x to 0.5.23, with k_scale / v_scale): a
# wrapper hiding the signature (no functools.wraps) gets these positionally; the later keywords keep their
# defaults (has_mla: v_buffer is a view of the same rows; page_size 1: token slots, the same addressing)
DOCUMENTED_ORDER = ("q", "k_buffer", "v_buffer", "o", "kv_indptr", "kv_indices", "attn_logits", "attn_lse",
                    "num_kv_splits", "max_kv_splits", "sm_scale", "k_scale", "v_scale", "logit_cap")  # fmt: skip


def kernel_call(fn: Callable, values: dict[str, Any]) -> tuple[list[Any], dict[str, Any], list[str]]:
    """(positional, keyword arguments, notes) for ``fn``: by keyword from its signature, or where
    that cannot be read, positionally by :data:`DOCUMENTED_ORDER`."""
    why = unreadable_signature(fn)
    if why is None:
        return ([], *build_kernel_kwargs(fn, values))
    return positional_for(fn, values, DOCUMENTED_ORDER), {}, [f"{why}: called by SGLang's documented parameter order"]


def build_kernel_kwargs(fn: Callable, values: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """Keyword arguments for ``fn`` from ``values`` by its signature, and notes on what was left out.

    Raises KernelSignatureError (a TypeError) when ``fn`` requires a parameter refmla does not
    know, or when a value that changes the math (k_scale / v_scale other than 1) has no parameter
    to go to.
    """
    kwargs = kwargs_for(fn, values)
    params = inspect.signature(fn).parameters
    notes = []
    if "page_size" not in params and int(values.get("page_size", 1)) != 1:
        notes.append(f"page_size {values['page_size']} not a parameter here; token-slot addressing is identical")
    if "has_mla" not in params and "has_mla" in values:
        notes.append("has_mla not a parameter here: V is read from v_buffer, a view of the same rows")
    return kwargs, notes


def _mla_tune_plan(mod, q: torch.Tensor, kv_buffer: torch.Tensor, max_kv_splits: int) -> tuple[bool, int, str]:
    """(tuned path taken, batch-wide split count or 0, note) of SGLang's gfx950 MLA tuning.

    On HIP gfx950 with SGLANG_MLA_DECODE_TUNE, ``_mla_launch_plan`` may replace the per-request
    num_kv_splits by one batch-wide count that depends on max_kv_splits; then the buffers must
    keep the production size. Elsewhere (CPU, NVIDIA, older SGLang) it does not apply.
    """
    plan = getattr(mod, "_mla_launch_plan", None)
    if plan is None:
        return False, 0, "no _mla_launch_plan in this SGLang"
    try:
        tuned, forced = plan(q, kv_buffer, int(max_kv_splits), True)
    except Exception as e:  # it reads the device and SGLang's runtime context
        return False, 0, f"_mla_launch_plan not evaluated ({type(e).__name__}: {e})"
    if not tuned:
        return False, 0, "does not apply (not HIP gfx950 with SGLANG_MLA_DECODE_TUNE)"
    if forced:
        return True, int(forced), f"applies: batch-wide {forced} splits replace num_kv_splits"
    return True, 0, "applies: tuned geometry, scheduler's num_kv_splits kept"


@dataclass
class SplitPlan:
    """How many splits the kernel's buffers hold, and why."""

    production: int  # max_kv_splits of the production call (the buffers' production size)
    used: int  # S: splits the buffers hold here (production, or trimmed to the non-empty ones)
    filled: torch.Tensor  # [B] non-empty splits per request
    forced: int  # gfx950 tuning: one batch-wide split count that replaced num_kv_splits, or 0
    tune_note: str  # what SGLang's gfx950 MLA tuning does here
    block_n: int = MIN_BLOCK_KV  # stage 1's online-softmax step (BLOCK_N), as the kernel picks it here

    @property
    def nonempty_max(self) -> int:
        return int(self.filled.max()) if self.filled.numel() else 0


@dataclass(frozen=True)
class TritonLaunch:
    """How the decode kernel is launched, besides its tensors and scales."""

    page_size: int = 1  # passed to the kernel (token slots: its page arithmetic is the identity)
    max_kv_splits: Optional[int] = None  # the production stage-1 buffer size (default max(num_kv_splits))
    trim: bool = True  # size the buffers to the splits that hold tokens (bit-identical)
    out_dtype: Optional[torch.dtype] = None  # default q's
    fill: float = float("nan")  # what out, attn_logits and attn_lse hold before the kernel runs


def run_triton_decode(
    q: torch.Tensor,
    kv_buffer: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    num_kv_splits: torch.Tensor,
    sc: Scales,
    launch: TritonLaunch = TritonLaunch(),
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict]:
    """Run SGLang's ``decode_attention_fwd`` (MLA) on plain tensors, on their device.

    q [B, H, D], kv_buffer [N, 1, D] (V = its first kv_lora_rank dims), kv_indptr [B + 1],
    kv_indices token slots, num_kv_splits [B]. ``launch.max_kv_splits`` is the production buffer
    size (default max(num_kv_splits)); with ``launch.trim`` the buffers hold only as many splits as
    the longest-split request fills (exact, see the module docstring).

    Returns out [B, H, Dv] (out_dtype, default q's), attn_logits [B, H, S, Dv] and attn_lse
    [B, H, S] fp32 exactly as the kernel leaves them (partials without v_scale; empty splits NaN,
    as allocated), and an info dict. A zero-length request's output row is NaN (0 / 0 in stage 2).
    """
    fn, module_path, version = locate_decode_kernel()
    mod = _kernel_module(module_path)
    Dv = int(sc.kv_lora_rank)
    interpreted, dot_fix = interpreter_ready(mod, q, kv_buffer, launch.out_dtype)
    q, kv_buffer, kv_indptr, kv_indices, splits = _kernel_inputs(q, kv_buffer, kv_indptr, kv_indices, num_kv_splits)
    plan = _split_plan(mod, q, kv_buffer, kv_indptr, splits, launch.max_kv_splits, launch.trim)
    out, attn_logits, attn_lse = _buffers(q, plan.used, Dv, launch.out_dtype or q.dtype, launch.fill)
    values = dict(
        q=q, k_buffer=kv_buffer, v_buffer=kv_buffer[..., :Dv], o=out, kv_indptr=kv_indptr,
        kv_indices=kv_indices, attn_logits=attn_logits, attn_lse=attn_lse, num_kv_splits=splits,
        max_kv_splits=plan.used, sm_scale=float(sc.sm_scale), k_scale=float(sc.k_scale), v_scale=float(sc.v_scale),
        logit_cap=float(sc.logit_cap), has_mla=True, page_size=int(launch.page_size),
    )  # fmt: skip
    args, kwargs, notes = kernel_call(fn, values)
    seconds = call_kernel(fn, kwargs, q.device, args)
    info = {
        "sglang_version": version,
        "kernel_module": module_path,
        "kernel": f"{module_path}.{fn.__name__}",
        "triton_version": _triton_version(),
        "device": str(q.device),
        "interpreter": interpreted,
        "bf16_dot_fix": dot_fix,
        **_split_info(plan),
        "kernel_params": sorted(kwargs) if kwargs else list(DOCUMENTED_ORDER),
        "attn_logits_include_v_scale": False,
        "kernel_seconds": round(seconds, 3),
    }
    if plan.forced:
        info["forced_kv_splits"] = plan.forced
    if notes:
        info["notes"] = notes
    return out, attn_logits, attn_lse, info


def interpreter_ready(
    mod, q: torch.Tensor, kv_buffer: torch.Tensor, out_dtype: Optional[torch.dtype]
) -> tuple[bool, bool]:
    """(kernel runs in the interpreter, bf16 dot fix installed). Raises RuntimeError when bf16 /
    fp8 inputs would run in the interpreter without refmla's fix."""
    if not triton_interp.module_is_interpreted(mod):
        return False, False
    ok, note = triton_interp.install_bf16_dot_fix()
    low = torch.bfloat16 in (q.dtype, kv_buffer.dtype, out_dtype) or kv_buffer.dtype.itemsize == 1
    if not ok and low:
        raise RuntimeError(f"bf16 / fp8 inputs in the Triton interpreter need refmla's fix: {note}")
    return True, triton_interp.bf16_dot_fix_installed()


def _kernel_inputs(q, kv_buffer, kv_indptr, kv_indices, num_kv_splits) -> tuple[torch.Tensor, ...]:
    """(q, kv_buffer, kv_indptr, kv_indices, num_kv_splits int32) on q's device, unit-stride last dim.

    The captured index dtypes stay as they are: SGLang's Triton backend keeps kv_indptr int32 and
    kv_indices int64, and an int32 kv_indices overflows slot * 576 past 3.7M rows -- a real failure
    class that a replay must reproduce, not hide. Raises ValueError for a kv_buffer not [N, 1, D].
    """
    _, _, D = q.shape
    if kv_buffer.dim() != 3 or kv_buffer.shape[1] != 1 or kv_buffer.shape[2] != D:
        raise ValueError(f"kv_buffer shape {list(kv_buffer.shape)}, expected [N, 1, {D}]")
    dev = q.device
    kv_indptr = kv_indptr.to(dev).contiguous()
    kv_indices = kv_indices.to(dev).contiguous()
    splits = num_kv_splits.to(dev, torch.int32).contiguous()
    if q.stride(-1) != 1:
        q = q.contiguous()
    kv_buffer = kv_buffer.to(dev)
    if kv_buffer.stride(-1) != 1:
        kv_buffer = kv_buffer.contiguous()
    return q, kv_buffer, kv_indptr, kv_indices, splits


def _split_plan(mod, q, kv_buffer, kv_indptr, splits, max_kv_splits: Optional[int], trim: bool) -> SplitPlan:
    """The buffers' split count: the production one, or with ``trim`` (and no gfx950 tuning, which
    needs the production size) the most non-empty splits of any request."""
    B = q.shape[0]
    seq_lens = (kv_indptr[1:] - kv_indptr[:-1]).cpu()  # [B], what the kernel reads
    production = int(max_kv_splits) if max_kv_splits else (int(splits.max()) if B else 1)
    min_block = int(getattr(mod, "_MIN_BLOCK_KV", MIN_BLOCK_KV))
    filled = nonempty_splits_batch(seq_lens, splits, min_block)  # [B]
    tuned, forced, tune_note = _mla_tune_plan(mod, q, kv_buffer, production)
    do_trim = bool(trim) and not tuned
    used = max(1, min(int(filled.max()) if B else 1, production)) if do_trim else production
    block_n = sglang_block_n(bool(getattr(mod, "_is_hip", False)), kv_buffer.shape[-1],
                             getattr(mod, "_MLA_BLOCK_N", None) if tuned else None)  # fmt: skip
    return SplitPlan(production=production, used=used, filled=filled, forced=forced, tune_note=tune_note,
                     block_n=block_n)  # fmt: skip


def _buffers(q: torch.Tensor, S: int, Dv: int, out_dtype: torch.dtype, fill: float = float("nan")) -> tuple[torch.Tensor, ...]:
    """out [B, H, Dv], attn_logits [B, H, S, Dv] fp32, attn_lse [B, H, S] fp32, all ``fill`` (NaN), on q's device."""
    B, H, _ = q.shape
    nan, dev = fill, q.device
    out = torch.full((B, H, Dv), nan, dtype=out_dtype, device=dev)  # [B, H, Dv]
    attn_logits = torch.full((B, H, S, Dv), nan, dtype=torch.float32, device=dev)  # [B, H, S, Dv]
    attn_lse = torch.full((B, H, S), nan, dtype=torch.float32, device=dev)  # [B, H, S]
    return out, attn_logits, attn_lse


def call_kernel(fn: Callable, kwargs: dict[str, Any], dev: torch.device, args: Sequence[Any] = ()) -> float:
    """Run the kernel (``fn(*args, **kwargs)``); its wall time in seconds."""
    t0 = time.perf_counter()
    # the interpreter computes masked-off lanes too (NaN-poisoned rows, empty splits): numpy's
    # warnings about them are noise, the masked results are discarded by the kernel
    with torch.no_grad(), np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        fn(*args, **kwargs)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return time.perf_counter() - t0


def _split_info(plan: SplitPlan) -> dict[str, Any]:
    return {
        "max_kv_splits": plan.production,
        "splits_used": plan.used,
        "nonempty_splits_max": plan.nonempty_max,
        "trimmed": plan.used < plan.production,
        "mla_tune": plan.tune_note,
        "block_n": plan.block_n,
    }


def _triton_version() -> str:
    try:
        import triton

        return triton.__version__
    except Exception:
        return "unknown"


# --------------------------------------------------------------------------------------------
# The backend
# --------------------------------------------------------------------------------------------


class TritonBackend(Backend):
    name = "triton"
    fills_buffers = True  # out, attn_logits and attn_lse are allocated here, filled with opts.buffer_fill
    modes = ("decode",)

    def availability(self) -> tuple[bool, str]:
        ok, how = triton_interp.triton_ready()
        if not ok:
            return False, how
        try:
            import sglang  # noqa: F401
        except Exception as e:
            return False, f"sglang not importable: {type(e).__name__}: {e}"
        import triton
        try:
            fn, module_path, version = locate_decode_kernel()
        except Exception as e:
            return False, str(e)
        ok, where = triton_interp.where_kernel_runs(_kernel_module(module_path))
        if not ok:
            return False, where
        return True, f"sglang {version} {module_path}.{fn.__name__}, triton {triton.__version__}, {where}"

    def run(self, cap: Capture, opts: ReplayOptions) -> BackendResult:
        m = cap.meta
        if m.mode != "decode":
            why = "; see triton_decode_per_query" if m.mode == "verify" else ""
            raise BackendUnavailable(f"decode kernel; capture is {m.mode} mode{why}")
        ok, why = self.availability()
        if not ok:
            raise BackendUnavailable(why)
        why = unsupported_shape(m.kv_lora_rank, m.qk_rope_head_dim)
        if why:
            raise BackendUnavailable(why)
        device = _device(opts)
        why = triton_interp.over_budget(cap) if device.type == "cpu" else None  # cpu: the interpreter
        if why:
            raise BackendUnavailable(why)
        splits, max_kv, source = _num_kv_splits(cap, opts)
        try:
            out, logits, lse, info = run_triton_decode(
                cap.q.to(device), cap.kv_buffer.to(device), cap.kv_indptr, cap.kv_indices, splits, cap.scales(),
                TritonLaunch(page_size=m.page_size, max_kv_splits=max_kv, trim=opts.trim, out_dtype=cap.out_dtype,
                             fill=float("nan") if opts.buffer_fill is None else opts.buffer_fill),
            )  # fmt: skip
        except KernelSignatureError as e:
            raise BackendUnavailable(str(e)) from e
        info["num_kv_splits_source"] = source
        if info.get("forced_kv_splits"):  # gfx950 tuning: one batch-wide count placed the partials
            splits = torch.full_like(splits.cpu(), info["forced_kv_splits"])
        return BackendResult(
            out=out.cpu(), attn_logits=logits.cpu(), attn_lse=lse.cpu(),
            num_kv_splits=splits.to(torch.int32).cpu(), info=info,
            arithmetic=replace(SGLANG_TRITON, p_block=info["block_n"]),  # its own 32-token splits and BLOCK_N
            defines_empty_rows=False,  # stage 2 divides 0 by 0 for a request with no tokens: NaN
        )  # fmt: skip


# SGLang's grouped MLA kernel splits the head dim into a latent block and a rope block only for
# these (Lk, Lv); any other Lk is one next_power_of_2(Lk) block, which works only without rope
# (Lk == Lv): decode_attention_fwd_grouped in sglang.kernels.ops.attention.decode_attention (0.5.23).
ROPE_SPLIT_SHAPES = {(576, 512), (288, 256)}


def unsupported_shape(kv_lora_rank: int, qk_rope_head_dim: int) -> Optional[str]:
    """The kernel's constraint a (value dim, rope dim) breaks, or None when it can run it."""
    Lk, Lv = kv_lora_rank + qk_rope_head_dim, kv_lora_rank
    if qk_rope_head_dim == 0 or (Lk, Lv) in ROPE_SPLIT_SHAPES:
        return None
    return (f"SGLang's Triton MLA decode kernel supports a rope part only as 512 + 64 or 256 + 32 "
            f"(or no rope); this capture has {Lv} + {qk_rope_head_dim}")  # fmt: skip


def _device(opts: ReplayOptions) -> torch.device:
    """The device to run SGLang's kernel on (:func:`device_for`)."""
    return device_for(locate_decode_kernel()[1], opts)


def device_for(module_path: str, opts: ReplayOptions) -> torch.device:
    """The device to run the kernels of ``module_path`` on: ``opts.device``, else CPU for the
    interpreter and CUDA for compiled kernels. Raises BackendUnavailable for a device they cannot use."""
    interpreted = bool(triton_interp.module_is_interpreted(_kernel_module(module_path)))
    device = opts.device
    if device is None:
        device = "cpu" if interpreted else "cuda"
    device = torch.device(device)
    if interpreted and device.type != "cpu":
        raise BackendUnavailable(f"the Triton interpreter runs on CPU tensors, not {device}")
    if not interpreted and device.type == "cpu":
        raise BackendUnavailable("compiled Triton kernels need a GPU device; run with TRITON_INTERPRET=1 for CPU")
    return device


def _num_kv_splits(cap: Capture, opts: ReplayOptions) -> tuple[torch.Tensor, int, str]:
    """(num_kv_splits [B], max_kv_splits, where they come from): the capture's, else SGLang's
    get_num_kv_splits recomputed for ``opts.cu_count`` (default an MI355X's)."""
    m = cap.meta
    cu_count = opts.cu_count
    if cap.num_kv_splits is not None:
        splits = cap.num_kv_splits
        return splits, m.max_kv_splits or (int(splits.max()) if cap.batch_size else 1), "capture"
    max_kv = m.max_kv_splits or mla_max_kv_splits(cu_count)
    splits = default_num_kv_splits(cap.seq_lens, max_kv_splits=max_kv, num_heads=cap.num_heads, cu_count=cu_count)
    return splits, max_kv, f"computed as SGLang's get_num_kv_splits (cu_count={cu_count}, max_kv_splits={max_kv})"


__all__ = ["KernelNotFound", "KernelSignatureError", "TritonBackend", "TritonLaunch", "DOCUMENTED_ORDER",
           "build_kernel_kwargs", "call_kernel", "device_for", "interpreter_ready", "locate_decode_kernel",
           "run_triton_decode", "unsupported_shape"]  # fmt: skip
