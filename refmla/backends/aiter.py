"""The ``aiter`` backend: aiter's MLA decode kernel, called the way SGLang's aiter backend calls it.

    q           [B, Hk, 576]          Hk = 16 for H < 16 (head padding, below), else H
    kv_buffer   [N, 1, 1, 576]        page size 1: the pool viewed as one-token pages
                [N / P, P, 1, 576]    page-level mode, P = the capture's page_size
    o           [B, Hk, 512]          allocated in the output dtype
    qo_indptr   arange(B + 1)         int32, one query token per request
    kv_indptr   [B + 1]               int32, over tokens (page size 1) or pages (page-level)
    kv_indices                        int32, token slots (page size 1) or page ids (page-level)
    kv_last_page_lens                 int32, ones (page size 1) or the last page's fill (page-level)
    max_seqlen_q = 1, page_size, nhead_kv = 1, sm_scale, logit_cap

Head padding (aiter's decode kernels want 16 heads or a multiple of 16): for H < 16 dividing 16,
q is ``repeat_interleave(16 // H)`` along heads and the output read back at every factor-th head
(``o[:, ::factor]``); other H < 16 are zero-padded to 16 and read back as ``o[:, :H]``.
(SGLang 0.5.23 tiles instead, ``q.repeat(1, 16 // H, 1)`` then ``o[:, :H]``: the same heads. The
bug docs/contract.md section 4 names ``head_misaligned`` is mixing the two: interleave, then ``[:H]``.)

The call is built by keyword from ``inspect.signature``: aiter v0.1.11 inserted ``page_size`` and
``nhead_kv`` before ``sm_scale``, so a positional call is wrong on one side of that release. Older
aiter reads the page size from ``kv_buffer.shape[1]``, which the view already sets.

The real aiter is recognised by ``aiter.mla`` (the PyPI package named ``aiter`` is unrelated and
has none). It needs a ROCm GPU. A module marking itself ``__refmla_standin__ = True`` (the test
stand-in in tests/standins/) is accepted on CPU and reported as a stand-in everywhere.
"""

from __future__ import annotations

import importlib
import time
from typing import Any, Callable, Optional

import torch

from refmla.backends.base import Backend, BackendResult, BackendUnavailable
from refmla.backends.calling import kwargs_for
from refmla.paged import token_to_page

AITER_HEADS = 16  # the smallest head count aiter's MLA decode kernels take


def locate_aiter() -> tuple[Any, str, bool]:
    """(the aiter.mla module, aiter version, is a stand-in). Raises BackendUnavailable saying why not."""
    try:
        aiter = importlib.import_module("aiter")
    except ModuleNotFoundError as e:
        if e.name == "aiter":
            raise BackendUnavailable("aiter is not installed (ROCm only; ships in SGLang's ROCm image)") from None
        raise BackendUnavailable(f"aiter import failed: {e}") from None
    except Exception as e:
        raise BackendUnavailable(f"aiter import failed: {type(e).__name__}: {e}") from None
    try:
        mla = importlib.import_module("aiter.mla")
    except Exception as e:
        raise BackendUnavailable(
            f"the installed 'aiter' ({getattr(aiter, '__file__', '?')}) has no usable aiter.mla "
            f"({type(e).__name__}: {e}); it is not ROCm aiter (never pip install aiter)"
        ) from None
    if not callable(getattr(mla, "mla_decode_fwd", None)):
        raise BackendUnavailable("aiter.mla has no mla_decode_fwd")
    standin = bool(getattr(aiter, "__refmla_standin__", False))
    return mla, _aiter_version(aiter), standin


def _aiter_version(aiter) -> str:
    v = getattr(aiter, "__version__", None)
    if v:
        return str(v)
    try:
        from importlib.metadata import version

        return version("amd-aiter")
    except Exception:
        return "unknown"


def aiter_status() -> tuple[bool, str]:
    """(usable here, version or reason). Never raises."""
    try:
        _, version, standin = locate_aiter()
    except BackendUnavailable as e:
        return False, str(e)
    if standin:
        return True, f"STAND-IN aiter {version} (tests only: computes the reference, not a kernel)"
    if not (torch.cuda.is_available() and getattr(torch.version, "hip", None)):
        return False, f"aiter {version} found but no ROCm GPU (torch {torch.__version__})"
    return True, f"aiter {version} aiter.mla.mla_decode_fwd on {torch.cuda.get_device_name(0)}"


# Parameters refmla fills, and names some releases use for the same thing.
_ALIASES = {"max_seqlen_qo": "max_seqlen_q"}


def kernel_kwargs(fn: Callable, values: dict[str, Any]) -> dict[str, Any]:
    """Keyword arguments for an aiter kernel by its signature (see refmla.backends.calling)."""
    return kwargs_for(fn, values, aliases=_ALIASES)


def pad_heads(q: torch.Tensor) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor], str]:
    """q [B, H, D] -> (q for the kernel [B, max(H, 16), D], output [B, Hk, Dv] -> [B, H, Dv], how)."""
    H = q.shape[1]
    if H >= AITER_HEADS:
        return q, (lambda o: o), "none"
    if AITER_HEADS % H == 0:
        f = AITER_HEADS // H
        return q.repeat_interleave(f, dim=1), (lambda o: o[:, ::f]), f"repeat_interleave({f}), output [::{f}]"
    padded = q.new_zeros(q.shape[0], AITER_HEADS, q.shape[2])
    padded[:, :H] = q
    return padded, (lambda o: o[:, :H]), f"zero-padded to {AITER_HEADS}, output [:{H}]"


def aiter_decode_args(
    q: torch.Tensor,
    kv_buffer: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    *,
    page_size: int = 1,
    device: Optional[torch.device] = None,
) -> tuple[dict[str, Any], str]:
    """The index arguments of mla_decode_fwd and the index convention used ("token" or "page").

    page_size > 1 converts SGLang's token slots to aiter pages (refmla.paged.token_to_page); a
    pool whose slots are not page-aligned (a compacted capture) falls back to page size 1.
    """
    dev = device or q.device
    B, D = q.shape[0], q.shape[2]
    i32 = dict(device=dev, dtype=torch.int32)
    convention, P = "token", 1
    if page_size > 1:
        try:
            page_indptr, page_indices, last = token_to_page(kv_indptr.long().cpu(), kv_indices.long().cpu(), page_size)
            convention, P = "page", int(page_size)
        except ValueError as e:
            convention = f"token (page_size {page_size} not usable: {e})"
    if P > 1:
        N = kv_buffer.shape[0]
        if N % P:  # whole pages only: pad the pool's tail (never attended)
            kv_buffer = torch.cat([kv_buffer, kv_buffer.new_zeros(P - N % P, *kv_buffer.shape[1:])])
        args = dict(kv_buffer=kv_buffer.to(dev).view(-1, P, 1, D), kv_indptr=page_indptr.to(**i32),
                    kv_indices=page_indices.to(**i32), kv_last_page_lens=last.to(**i32), page_size=P)  # fmt: skip
    else:
        args = dict(kv_buffer=kv_buffer.to(dev).view(-1, 1, 1, D), kv_indptr=kv_indptr.to(**i32),
                    kv_indices=kv_indices.to(**i32), kv_last_page_lens=torch.ones(B, **i32), page_size=1)  # fmt: skip
    args.update(qo_indptr=torch.arange(B + 1, **i32), max_seqlen_q=1, nhead_kv=1)
    return args, convention


def run_aiter_decode(
    q: torch.Tensor,
    kv_buffer: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    *,
    kv_lora_rank: int,
    sm_scale: float,
    logit_cap: float = 0.0,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    page_size: int = 1,
    out_dtype: Optional[torch.dtype] = None,
    device: Optional[torch.device] = None,
) -> tuple[torch.Tensor, dict]:
    """aiter.mla.mla_decode_fwd on plain tensors: out [B, H, Dv] (on CPU) and an info dict."""
    mla, version, standin = locate_aiter()
    fn = mla.mla_decode_fwd
    dev = torch.device(device or ("cpu" if standin else "cuda"))
    B, _, D = q.shape
    Dv = int(kv_lora_rank)
    if kv_buffer.dim() != 3 or kv_buffer.shape[1] != 1 or kv_buffer.shape[2] != D:
        raise ValueError(f"kv_buffer shape {list(kv_buffer.shape)}, expected [N, 1, {D}]")
    fp8 = kv_buffer.dtype.itemsize == 1
    if fp8 and k_scale != v_scale:
        raise BackendUnavailable(f"aiter takes one kv_scale; capture has k_scale {k_scale} != v_scale {v_scale}")
    if not fp8 and (k_scale != 1.0 or v_scale != 1.0):
        raise BackendUnavailable(
            f"k_scale/v_scale {k_scale}/{v_scale} on a {kv_buffer.dtype} pool: aiter has no such scales"
        )
    q_in, unpad, pad_how = pad_heads(q.to(dev).contiguous())
    args, convention = aiter_decode_args(q_in, kv_buffer, kv_indptr, kv_indices, page_size=page_size, device=dev)
    o = torch.empty(B, q_in.shape[1], Dv, dtype=out_dtype or q.dtype, device=dev)  # [B, Hk, Dv]
    scale = torch.tensor([float(k_scale)], dtype=torch.float32, device=dev) if fp8 else None
    values = dict(
        q=q_in, o=o, sm_scale=float(sm_scale), logit_cap=float(logit_cap), q_scale=scale, kv_scale=scale, **args
    )
    kwargs = kernel_kwargs(fn, values)
    notes = []
    if "page_size" not in kwargs and args["page_size"] > 1:
        notes.append("this aiter has no page_size parameter: it reads the page size from kv_buffer.shape[1]")
    t0 = time.perf_counter()
    with torch.no_grad():
        fn(**kwargs)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    info = {
        "aiter_version": version,
        "kernel": "aiter.mla.mla_decode_fwd",
        "stand_in": standin,
        "device": str(dev),
        "index_convention": convention,
        "page_size": args["page_size"],
        "head_padding": pad_how,
        "kernel_heads": int(q_in.shape[1]),
        "kernel_params": sorted(kwargs),
        "kernel_seconds": round(time.perf_counter() - t0, 3),
    }
    if notes:
        info["notes"] = notes
    return unpad(o).cpu(), info


class AiterBackend(Backend):
    name = "aiter"

    def availability(self) -> tuple[bool, str]:
        return aiter_status()

    def run(self, cap, opts) -> BackendResult:
        m = cap.meta
        if not cap.is_decode:
            raise BackendUnavailable("decode kernel; capture is extend mode")
        ok, why = self.availability()
        if not ok:
            raise BackendUnavailable(why)
        page_mode = getattr(opts, "aiter_page_size", None)
        P = int(page_mode) if page_mode else m.page_size
        out_dtype = cap.out_dtype
        lens = cap.seq_lens.long()
        try:
            out, info = run_aiter_decode(
                cap.q, cap.kv_buffer, cap.kv_indptr, cap.kv_indices, kv_lora_rank=m.kv_lora_rank,
                sm_scale=m.sm_scale, logit_cap=m.logit_cap, k_scale=m.k_scale, v_scale=m.v_scale,
                page_size=P, out_dtype=out_dtype, device=getattr(opts, "device", None),
            )  # fmt: skip
        except AssertionError as e:  # aiter asserts what it does not support (logit_cap > 0, head counts)
            raise BackendUnavailable(f"aiter refused this input: {e}") from None
        if bool((lens == 0).any()):
            info["zero_length_requests"] = "output rows of zero-length requests are not compared"
        return BackendResult(out=out, info=info, defines_empty_rows=not bool((lens == 0).any()))


__all__ = [
    "AiterBackend",
    "aiter_decode_args",
    "aiter_status",
    "kernel_kwargs",
    "locate_aiter",
    "pad_heads",
    "run_aiter_decode",
]
