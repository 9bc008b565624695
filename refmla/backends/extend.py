"""The ``extend`` backend: the local-extend baseline.

The same token computed the way the prefill / extend / verify path computes it. In extend
attention the cache holds only the *prefix*; the new tokens' latent K/V arrive as separate
tensors (the layer's freshly projected ``k``/``v``), and the new tokens attend causally,
bottom-right aligned:

    prefix   positions 0 .. L-n-1 of request b, read through kv_indptr / kv_indices (k_scale, v_scale)
    new      positions L-n .. L-1, passed directly as k_extend [T, 1, D], v_extend [T, 1, Dv]
    token i  (0-based among the n new ones) attends the prefix and new tokens 0 .. i

A decode capture is a one-token extend (n = 1): the current token's K/V come in as k_extend, the
other L-1 positions from the cache. Where the decode kernel and this path disagree on the same
captured state, the decode compute path is the suspect (refmla.diagnosis).

Two implementations, both run and both reported:

* :func:`mla_extend_local`, pure PyTorch at the kernel's rounding points with extend semantics
  (any number of new tokens, so ``extend`` captures replay too);
* SGLang's Triton ``extend_attention_fwd`` (``sglang.kernels.ops.attention.extend_attention`` from
  0.5.16, ``sglang.srt.layers.attention.triton_ops.extend_attention`` before), located and called
  by keyword from its signature, in the Triton interpreter on a machine without a GPU.

The backend's output is SGLang's kernel when it can run (that *is* the production extend path),
else the PyTorch one (``info["implementation"]`` says which, and why). The other implementation's
comparison with the reference goes in ``info`` (``info["torch_extend"]`` /
``info["sglang_triton_extend"]``), and aiter's ``mla_prefill_fwd`` in ``info["aiter_prefill"]``
where a real aiter (``aiter.mla``) is installed. ``REFMLA_EXTEND_IMPL=torch|triton|auto`` (or
``opts.extend_impl``) picks the primary by hand.

Where the new tokens' K/V come from. Production passed the layer's bf16 ``k``/``v``; the capture
has them only as cache rows. For a bf16 pool the row *is* that tensor; for an fp8 pool (stored as
value / k_scale) the row is dequantized, ``(row * k_scale).to(q.dtype)``, which differs from what
production passed by the fp8 rounding of those n rows only.

fp8 pools: SGLang's extend kernel rounds all of q (the rope part too) to the pool dtype for the
prefix dot, and P to the pool dtype before P.V; the PyTorch implementation does the same. That is
noisier than the decode control the comparator measures against, so an fp8 capture can fail the
extend path by a small margin without a fault; and the Triton interpreter's fp8 conversions are
not covered by refmla's bf16 fix (``info["triton"]["note"]`` says so).
"""

from __future__ import annotations

import importlib
import inspect
import math
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from refmla import reference as ref
from refmla.backends import triton_interp
from refmla.backends.base import Backend, BackendResult, BackendUnavailable
from refmla.backends.calling import find_function, kwargs_for
from refmla.control import mla_control

# Where SGLang keeps the extend kernel: from 0.5.16 on, then up to 0.5.15.
EXTEND_KERNEL_MODULES = (
    "sglang.kernels.ops.attention.extend_attention",
    "sglang.srt.layers.attention.triton_ops.extend_attention",
)
IMPL_ENV = "REFMLA_EXTEND_IMPL"


# --------------------------------------------------------------------------------------------
# The capture as the extend path sees it
# --------------------------------------------------------------------------------------------


@dataclass
class ExtendInputs:
    """One extend call: prefix through the cache, new tokens' K/V as tensors."""

    q_extend: torch.Tensor  # [T, H, D] the new tokens' queries (rows of requests with tokens)
    k_extend: torch.Tensor  # [T, 1, D] their latent K, dequantized, in q's dtype
    v_extend: torch.Tensor  # [T, 1, Dv] their latent V (first Dv dims), dequantized, in q's dtype
    qo_indptr: torch.Tensor  # [B + 1] int64, request b's new tokens are rows qo_indptr[b]:qo_indptr[b+1]
    prefix_indptr: torch.Tensor  # [B + 1] int64 over prefix_indices
    prefix_indices: torch.Tensor  # [sum(L_b - n_b)] int64 token slots of the prefixes, position order
    out_rows: torch.Tensor  # [T] which row of the capture's `out` each new token is
    num_rows: int  # rows of the capture's `out` (decode: B; extend: T)

    @property
    def max_len_extend(self) -> int:
        n = self.qo_indptr[1:] - self.qo_indptr[:-1]
        return int(n.max()) if n.numel() else 0


def dequant_rows(rows: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Cache rows -> the tensor the layer would have passed: (rows * scale) in ``dtype``."""
    if scale != 1.0 or rows.dtype.itemsize == 1:
        return (rows.to(torch.float32) * scale).to(dtype)
    return rows.to(dtype)


def as_extend(cap) -> ExtendInputs:
    """Split every request of a capture into its cached prefix and its new tokens.

    Decode: one new token per request with L >= 1 (a zero-length request has no token to
    recompute; its output row stays 0, the reference's value). Extend: the capture's qo_indptr.
    """
    m = cap.meta
    B, Dv = cap.batch_size, m.kv_lora_rank
    lens = (cap.kv_indptr[1:] - cap.kv_indptr[:-1]).long()  # [B]
    if cap.is_decode:
        n = (lens > 0).long()  # [B]
        rows_of_b = [[b] if int(n[b]) else [] for b in range(B)]
        num_rows = B
    else:
        qo = cap.qo_indptr.long()
        n = qo[1:] - qo[:-1]
        rows_of_b = [list(range(int(qo[b]), int(qo[b + 1]))) for b in range(B)]
        num_rows = cap.q.shape[0]
    qo_indptr = torch.zeros(B + 1, dtype=torch.int64)
    qo_indptr[1:] = torch.cumsum(n, 0)
    prefix_lens = lens - n  # [B]
    prefix_indptr = torch.zeros(B + 1, dtype=torch.int64)
    prefix_indptr[1:] = torch.cumsum(prefix_lens, 0)
    prefix, new = [], []
    for b in range(B):
        rows = ref.request_rows(cap.kv_indptr, cap.kv_indices, b)  # [L_b]
        prefix.append(rows[: int(prefix_lens[b])])
        new.append(rows[int(prefix_lens[b]) :])
    empty = torch.zeros(0, dtype=torch.int64)
    new_rows = torch.cat(new) if new else empty  # [T]
    out_rows = torch.tensor([r for rs in rows_of_b for r in rs], dtype=torch.int64)
    kv_new = cap.kv_buffer[:, 0].index_select(0, new_rows)  # [T, D] stored dtype
    qd = cap.q.dtype if cap.q.dtype.itemsize >= 2 else torch.bfloat16
    return ExtendInputs(
        q_extend=cap.q.index_select(0, out_rows),
        k_extend=dequant_rows(kv_new, m.k_scale, qd)[:, None, :],
        v_extend=dequant_rows(kv_new[:, :Dv], m.v_scale, qd)[:, None, :],
        qo_indptr=qo_indptr,
        prefix_indptr=prefix_indptr,
        prefix_indices=torch.cat(prefix) if prefix else empty,
        out_rows=out_rows,
        num_rows=num_rows,
    )


def scatter_rows(x: torch.Tensor, inp: ExtendInputs, fill: float = 0.0) -> torch.Tensor:
    """[T, H, ...] of the new tokens -> [R, H, ...] rows of the capture (others ``fill``)."""
    out = x.new_full((inp.num_rows, *x.shape[1:]), fill)
    out[inp.out_rows] = x
    return out


# --------------------------------------------------------------------------------------------
# Pure PyTorch, at the kernel's rounding points
# --------------------------------------------------------------------------------------------


def mla_extend_local(
    inp: ExtendInputs,
    kv_buffer: torch.Tensor,
    *,
    kv_lora_rank: int,
    sm_scale: float,
    logit_cap: float = 0.0,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    out_dtype: torch.dtype = torch.bfloat16,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Extend attention as SGLang's extend kernel rounds it: out [T, H, Dv] out_dtype, lse [T, H] fp32.

    Prefix logits ``q.to(K dtype) . K_cache`` (fp32 accumulation) times sm_scale * k_scale; new-token
    logits ``q . k_extend`` times sm_scale (k_extend is already dequantized); soft cap; one softmax
    over both, causal for the new tokens; probabilities rounded to each V's dtype before P.V, fp32
    sums from the unrounded probabilities; prefix P.V times v_scale; output rounded to out_dtype.
    """
    f32, Dv = torch.float32, int(kv_lora_rank)
    T, H, _ = inp.q_extend.shape
    out = torch.zeros(T, H, Dv, dtype=out_dtype)  # [T, H, Dv]
    lse = torch.full((T, H), -math.inf, dtype=f32)  # [T, H]
    for b in range(len(inp.qo_indptr) - 1):
        t0, t1 = int(inp.qo_indptr[b]), int(inp.qo_indptr[b + 1])
        if t1 == t0:
            continue
        n = t1 - t0
        q = inp.q_extend[t0:t1]  # [n, H, D]
        pre = ref.gather(kv_buffer, ref.request_rows(inp.prefix_indptr, inp.prefix_indices, b), kv_buffer.dtype)
        k_new, v_new = inp.k_extend[t0:t1, 0], inp.v_extend[t0:t1, 0]  # [n, D], [n, Dv]
        s_pre = torch.einsum("thd,ld->thl", q.to(pre.dtype).to(f32), pre.to(f32)) * (sm_scale * k_scale)  # [n, H, Lp]
        s_new = torch.einsum("thd,ld->thl", q.to(f32), k_new.to(f32)) * sm_scale  # [n, H, n]
        if logit_cap > 0:
            s_pre = logit_cap * torch.tanh(s_pre / logit_cap)
            s_new = logit_cap * torch.tanh(s_new / logit_cap)
        causal = torch.ones(n, n, dtype=torch.bool).tril()  # token i sees new tokens 0..i
        s_new = s_new.masked_fill(~causal[:, None, :], -math.inf)
        m = torch.maximum(
            s_pre.amax(-1) if s_pre.shape[-1] else torch.full((n, H), -math.inf), s_new.amax(-1)
        )  # [n, H]
        p_pre, p_new = torch.exp(s_pre - m[..., None]), torch.exp(s_new - m[..., None])  # fp32
        denom = p_pre.sum(-1) + p_new.sum(-1)  # [n, H] from unrounded probabilities
        acc = torch.einsum("thl,lv->thv", p_pre.to(pre.dtype).to(f32), pre[:, :Dv].to(f32)) * v_scale
        acc = acc + torch.einsum("thl,lv->thv", p_new.to(v_new.dtype).to(f32), v_new.to(f32))  # [n, H, Dv]
        out[t0:t1] = (acc / denom[..., None]).to(out_dtype)
        lse[t0:t1] = m + torch.log(denom)
    return out, lse


# --------------------------------------------------------------------------------------------
# SGLang's Triton extend kernel
# --------------------------------------------------------------------------------------------

_located: Optional[tuple[Callable, str]] = None


def locate_extend_kernel() -> tuple[Callable, str]:
    """(extend_attention_fwd, its module path), the new path first. Raises RuntimeError saying why not."""
    global _located
    if _located is not None:
        return _located
    triton_interp.ensure_interpreter()  # before the first import of triton
    _located = find_function(EXTEND_KERNEL_MODULES, "extend_attention_fwd", "SGLang's Triton extend kernel")
    return _located


def triton_extend_status() -> tuple[bool, str]:
    """(runnable here, note): SGLang's kernel found and either a GPU or the interpreter (bf16 fix)."""
    interp, how = triton_interp.ensure_interpreter()
    try:
        import triton
    except Exception as e:
        return False, f"triton not importable: {type(e).__name__}: {e}"
    if not interp and not triton_interp.gpu_present():
        return False, how
    try:
        fn, path = locate_extend_kernel()
    except Exception as e:
        return False, str(e)
    interpreted = triton_interp.module_is_interpreted(importlib.import_module(path))
    if interpreted:
        ok, note = triton_interp.install_bf16_dot_fix()
        if not ok:
            return False, note
        where = "interpreter (bf16 dot fix applied)"
    elif triton_interp.gpu_present():
        where = "compiled"
    else:
        return False, f"{path} was imported compiled and there is no GPU; set TRITON_INTERPRET=1"
    return True, f"sglang {_sglang_version()} {path}.{fn.__name__}, triton {triton.__version__}, {where}"


def run_triton_extend(
    inp: ExtendInputs,
    kv_buffer: torch.Tensor,
    *,
    kv_lora_rank: int,
    sm_scale: float,
    logit_cap: float = 0.0,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    out_dtype: torch.dtype = torch.bfloat16,
    device: Optional[torch.device] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor], dict]:
    """SGLang's ``extend_attention_fwd`` on the prefix/new-token split: out [T, H, Dv], lse [T, H] or None, info."""
    fn, path = locate_extend_kernel()
    interpreted = bool(triton_interp.module_is_interpreted(importlib.import_module(path)))
    if interpreted:
        ok, note = triton_interp.install_bf16_dot_fix()
        if not ok:
            raise RuntimeError(f"bf16 in the Triton interpreter needs refmla's fix: {note}")
    dev = torch.device(device or ("cpu" if interpreted else "cuda"))
    Dv = int(kv_lora_rank)
    T, H, _ = inp.q_extend.shape
    i32 = torch.int32 if kv_buffer.shape[0] < 2**31 else torch.int64
    kvb = kv_buffer.to(dev)
    params = inspect.signature(fn).parameters
    lse = torch.full((T, H), math.nan, dtype=torch.float32, device=dev) if "lse_extend" in params else None
    o = torch.full((T, H, Dv), math.nan, dtype=out_dtype, device=dev)  # [T, H, Dv]
    values = dict(
        q_extend=inp.q_extend.to(dev).contiguous(), k_extend=inp.k_extend.to(dev).contiguous(),
        v_extend=inp.v_extend.to(dev).contiguous(), o_extend=o, k_buffer=kvb, v_buffer=kvb[..., :Dv],
        qo_indptr=inp.qo_indptr.to(dev, torch.int32), kv_indptr=inp.prefix_indptr.to(dev, i32),
        kv_indices=inp.prefix_indices.to(dev, i32), custom_mask=None, is_causal=True, mask_indptr=None,
        max_len_extend=inp.max_len_extend, k_scale=float(k_scale), v_scale=float(v_scale),
        sm_scale=float(sm_scale), logit_cap=float(logit_cap), lse_extend=lse, page_size=1,
    )  # fmt: skip
    kwargs = kwargs_for(fn, values)
    t0 = time.perf_counter()
    if T:
        import numpy as np

        # the interpreter computes log(0) for rows with no key before masking them: not a finding
        with torch.no_grad(), np.errstate(divide="ignore", invalid="ignore"):
            fn(**kwargs)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    info = {
        "kernel": f"{path}.{fn.__name__}",
        "sglang_version": _sglang_version(),
        "interpreter": interpreted,
        "device": str(dev),
        "kernel_params": sorted(kwargs),
        "page_size_passed": 1,  # token slots: the kernel's page arithmetic is the identity on them
        "kernel_seconds": round(time.perf_counter() - t0, 3),
    }
    if interpreted and kv_buffer.dtype.itemsize == 1:
        info["note"] = "fp8 pool in the Triton interpreter: its fp8 conversions are not verified by refmla"
    return o.cpu(), (lse.cpu() if lse is not None else None), info


# --------------------------------------------------------------------------------------------
# aiter's mla_prefill_fwd (real aiter only; see refmla.backends.aiter)
# --------------------------------------------------------------------------------------------


def run_aiter_prefill(cap, inp: ExtendInputs, out_dtype: torch.dtype, device: Optional[str] = None):
    """aiter.mla.mla_prefill_fwd over the whole sequence (new tokens read from the cache, page size 1)."""
    from refmla.backends.aiter import kernel_kwargs as aiter_kwargs
    from refmla.backends.aiter import locate_aiter, pad_heads

    mla, version, standin = locate_aiter()
    fn = getattr(mla, "mla_prefill_fwd", None)
    if fn is None:
        raise BackendUnavailable(f"aiter {version} has no mla.mla_prefill_fwd")
    m = cap.meta
    dev = torch.device(device or ("cpu" if standin else "cuda"))
    T, _, D = inp.q_extend.shape
    B = cap.batch_size
    q_in, unpad, pad_how = pad_heads(inp.q_extend.to(dev).contiguous())  # as for decode: 16 heads at least
    o = torch.empty(T, q_in.shape[1], m.kv_lora_rank, dtype=out_dtype, device=dev)
    values = dict(
        q=q_in, kv_buffer=cap.kv_buffer.to(dev).view(-1, 1, 1, D), o=o,
        qo_indptr=inp.qo_indptr.to(dev, torch.int32), kv_indptr=cap.kv_indptr.to(dev, torch.int32),
        kv_indices=cap.kv_indices.to(dev, torch.int32),
        kv_last_page_lens=torch.ones(B, dtype=torch.int32, device=dev),
        max_seqlen_q=inp.max_len_extend, sm_scale=float(m.sm_scale), logit_cap=float(m.logit_cap),
    )  # fmt: skip
    fn(**aiter_kwargs(fn, values))
    return unpad(o).cpu(), {"kernel": "aiter.mla.mla_prefill_fwd", "aiter_version": version, "stand_in": standin,
                            "head_padding": pad_how}  # fmt: skip


# --------------------------------------------------------------------------------------------
# The backend
# --------------------------------------------------------------------------------------------


def _sglang_version() -> str:
    try:
        from importlib.metadata import version

        return version("sglang")
    except Exception:
        return "unknown"


def _chosen_impl(opts) -> str:
    impl = (getattr(opts, "extend_impl", None) or os.environ.get(IMPL_ENV) or "auto").lower()
    if impl not in ("auto", "torch", "triton"):
        raise BackendUnavailable(f"{IMPL_ENV}={impl!r}: choose auto, torch or triton")
    return impl


def summarize(cmp) -> dict:
    """A secondary implementation's comparison, as a small JSON dict."""
    d = {"status": "pass" if cmp.passed else "fail", "max_abs_err": cmp.max_abs_err, "cos_diff": cmp.cos_diff,
         "worst": {"request": cmp.worst.get("request"), "head": cmp.worst.get("head")}}  # fmt: skip
    if not cmp.passed:
        d["reason"] = "; ".join(cmp.reasons)
    return d


class ExtendBackend(Backend):
    name = "extend"

    def availability(self) -> tuple[bool, str]:
        ok, note = triton_extend_status()
        if ok:
            return True, f"local extend: {note}; pure PyTorch alongside"
        return True, f"local extend: pure PyTorch {torch.__version__} (SGLang Triton extend unavailable: {note})"

    def run(self, cap, opts) -> BackendResult:
        from refmla.backends.reference import reference_output
        from refmla.compare import compare

        impl = _chosen_impl(opts)
        m = cap.meta
        out_dtype = cap.out_dtype
        inp = as_extend(cap)
        sc = dict(kv_lora_rank=m.kv_lora_rank, sm_scale=m.sm_scale, logit_cap=m.logit_cap,
                  k_scale=m.k_scale, v_scale=m.v_scale)  # fmt: skip
        t0 = time.perf_counter()
        t_out, t_lse = mla_extend_local(inp, cap.kv_buffer, **sc, out_dtype=out_dtype)
        torch_s = round(time.perf_counter() - t0, 3)

        tri = None
        tri_entry: dict[str, Any]
        if impl == "torch":
            tri_entry = {"status": "skipped", "reason": f"{IMPL_ENV}=torch"}
        else:
            ok, note = triton_extend_status()
            if not ok:
                if impl == "triton":
                    raise BackendUnavailable(f"SGLang Triton extend: {note}")
                tri_entry = {"status": "skipped", "reason": note}
            else:
                try:
                    tri = run_triton_extend(
                        inp, cap.kv_buffer, **sc, out_dtype=out_dtype, device=getattr(opts, "device", None)
                    )
                    tri_entry = {}
                except Exception as e:
                    if impl == "triton":
                        raise
                    tri_entry = {
                        "status": "error",
                        "reason": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
                    }

        tol = getattr(opts, "tol", None)
        kw = {"tol": tol} if tol is not None else {}
        truth: list = []  # reference and control, computed only if a second implementation is judged

        def judged(name: str, out: torch.Tensor) -> dict:
            if not truth:
                qo = None if cap.is_decode else cap.qo_indptr
                args = (cap.q, cap.kv_buffer, cap.kv_indptr, cap.kv_indices)
                truth.extend(
                    [reference_output(cap)[0], mla_control(*args, **sc, out_dtype=out_dtype, qo_indptr=qo)[0]]
                )
            cmp = compare(name, out, truth[0], truth[1], out_dtype=out_dtype, request_of_row=cap.request_of_row(), **kw)
            return summarize(cmp)

        info: dict[str, Any] = {
            "prefix": "positions 0..L-n-1 through kv_indptr/kv_indices",
            "new_tokens": "positions L-n..L-1 as k_extend/v_extend (dequantized cache rows), causal bottom-right",
            "new_tokens_per_request": "1 (decode step as a one-token extend)" if cap.is_decode else "qo_indptr",
        }
        torch_full = scatter_rows(t_out, inp)
        if tri is not None:
            o, lse, tinfo = tri
            out, out_lse = scatter_rows(o, inp), (scatter_rows(lse, inp, -math.inf) if lse is not None else None)
            info["implementation"] = "sglang_triton"
            info["triton"] = tinfo
            info["torch_extend"] = {**judged("torch_extend", torch_full), "seconds": torch_s}
        else:
            out, out_lse = torch_full, scatter_rows(t_lse, inp, -math.inf)
            info["implementation"] = "torch"
            info["sglang_triton_extend"] = tri_entry
        info["aiter_prefill"] = self._aiter_prefill(cap, inp, out_dtype, opts, judged)
        return BackendResult(out=out, lse=out_lse, info=info, defines_empty_rows=True)

    @staticmethod
    def _aiter_prefill(cap, inp, out_dtype, opts, judged) -> dict:
        from refmla.backends.aiter import aiter_status

        ok, why = aiter_status()
        if not ok:
            return {"status": "skipped", "reason": why}
        try:
            o, info = run_aiter_prefill(cap, inp, out_dtype, getattr(opts, "device", None))
        except Exception as e:
            return {"status": "error", "reason": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
        return {**judged("aiter_prefill", scatter_rows(o, inp)), **info}


__all__ = [
    "ExtendBackend",
    "ExtendInputs",
    "as_extend",
    "locate_extend_kernel",
    "mla_extend_local",
    "run_triton_extend",
    "scatter_rows",
]
