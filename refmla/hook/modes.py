"""One reader per capture mode: what the kernel attended, and what the mode's kernel left behind.

A :class:`ModeReader` has three parts, run by :func:`refmla.hook.extract.after` in this order:

* ``indices(ctx) -> Indices``: the whole sequences the call attended, as ``refmla.capture/1``
  stores them (token-level ``kv_indptr`` / ``kv_indices``, plus ``qo_indptr`` when a request
  has several query tokens); raise :class:`Skip` for what the format cannot describe;
* ``kernel(ctx, partials)``: after the KV pool is read, the mode's kernel state (Triton
  decode's split schedule and stage-1 partials) and mode-only checks (extend: the pool holds the
  call's new K);
* ``meta``: meta providers of this mode only (see :mod:`refmla.hook.meta`).

Another mode is a reader here under that mode's name, returned by
:func:`refmla.hook.filters.forward_kind`. ``verify`` (speculative ``target_verify`` and
``draft_extend``: several query tokens per request, ``qo_indptr``, SGLang's ``custom_mask`` +
``mask_indptr``) is one.

The torch side of the hook (imported on the first captured call, never at start-up).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from refmla.hook.call import CallContext, Indices, Skip
from refmla.hook.meta import MetaProvider, triton_decode_meta, verify_meta
from refmla.hook.nvidia import NVIDIA, nvidia_meta
from refmla.hook.tensors import gather_rows


@dataclass(frozen=True)
class ModeReader:
    indices: Callable[[CallContext], Indices]
    kernel: Callable[[CallContext, bool], None]
    meta: tuple[MetaProvider, ...] = ()


# ---------------------------------------------------------------------------------------------
# decode: one query token per request
# ---------------------------------------------------------------------------------------------


def decode_indices(ctx: CallContext) -> Indices:
    """Exactly what the kernel read (``forward_metadata.kv_indptr / kv_indices``, or what each of
    SGLang's NVIDIA backends read: :data:`refmla.hook.nvidia.NVIDIA`)."""
    B = ctx.q.shape[0]
    if ctx.call.backend in NVIDIA:
        return NVIDIA[ctx.call.backend].indices(ctx)
    kv_indptr = ctx.md.kv_indptr[: B + 1].to("cpu", torch.int64)  # [B + 1]
    if kv_indptr.shape[0] != B + 1:
        raise Skip(f"kv_indptr has {kv_indptr.shape[0]} entries for {B} requests")
    kv_indices = ctx.md.kv_indices[int(kv_indptr[0]) : int(kv_indptr[-1])].to("cpu", torch.int64)
    return Indices(kv_indptr - kv_indptr[0], kv_indices, None, B)


def decode_kernel(ctx: CallContext, partials: bool) -> None:
    if ctx.call.backend == "triton":
        triton_schedule(ctx, partials)


def triton_schedule(ctx: CallContext, partials: bool) -> None:
    """num_kv_splits [B] int32, attn_logits [B,H,S,Dv] / attn_lse [B,H,S] views, as the kernel used them.

    The kernel's own notes (from the probes on its module) say whether SGLang's gfx950 tuning
    replaced the per-request counts by one batch-wide count, or whether the Lean kernel ran
    (no splits, no partials). S is cut to the largest split count of the batch.
    """
    md, B, H, seen = ctx.md, ctx.batch_size, ctx.heads, ctx.call.kernel_notes
    sched = getattr(md, "num_kv_splits", None)
    if sched is None:
        return
    sched = sched[:B].to("cpu", torch.int32)
    forced = int(seen.get("forced_kv_splits", 0) or 0)
    if seen.get("lean"):
        ctx.notes.update(decode_kernel="lean", sched_num_kv_splits=sched.tolist())
        return
    if forced > 0:
        ctx.notes.update(sched_num_kv_splits=sched.tolist(), forced_kv_splits=forced)
        num_kv_splits = torch.full((B,), forced, dtype=torch.int32)
    else:
        num_kv_splits = sched
    ctx.notes["decode_kernel"] = "grouped_mla_tuned" if seen.get("mla_tuned") else ("grouped" if H > 1 else "normal")
    ctx.num_kv_splits = num_kv_splits
    logits, lse = getattr(md, "attn_logits", None), getattr(md, "attn_lse", None)
    if not partials or logits is None or lse is None:
        return
    S = min(int(logits.shape[2]), max(int(num_kv_splits.max()) if B else 1, 1))
    ctx.attn_logits, ctx.attn_lse = logits[:B, :, :S], lse[:B, :, :S]


# ---------------------------------------------------------------------------------------------
# extend: a prefix from the cache plus new tokens, several query tokens per request
# ---------------------------------------------------------------------------------------------


def extend_indices(ctx: CallContext) -> Indices:
    """The prefix the kernel read from the metadata, then each request's new-token slots.

    The kernel read the new tokens from ``k``; the capture format wants the whole sequence, so
    each request's new-token slots (``forward_batch.out_cache_loc``, where the call wrote them)
    follow its prefix.
    """
    if getattr(ctx.md, "custom_mask", None) is not None:
        raise Skip("extend with a custom mask outside a speculative pass: not in refmla.capture/1")
    return prefix_and_new(ctx)


def prefix_and_new(ctx: CallContext) -> Indices:
    """extend_indices without the mask check: the Triton layout of extend and verify alike."""
    md, fb, T = ctx.md, ctx.forward_batch, ctx.q.shape[0]
    qo = getattr(md, "qo_indptr", None)
    if qo is None or getattr(md, "kv_indices", None) is None or md.kv_indices.dim() != 1:
        raise Skip("extend metadata without token-level qo_indptr / kv_indices")
    B = int(fb.batch_size)
    qo_indptr = qo[: B + 1].to("cpu", torch.int64)
    if int(qo_indptr[-1]) - int(qo_indptr[0]) != T:
        raise Skip(f"qo_indptr covers {int(qo_indptr[-1] - qo_indptr[0])} tokens, q has {T}")
    qo_indptr = qo_indptr - qo_indptr[0]
    pre_indptr = md.kv_indptr[: B + 1].to("cpu", torch.int64)
    pre_indices = md.kv_indices[int(pre_indptr[0]) : int(pre_indptr[-1])].to("cpu", torch.int64)
    pre_indptr = pre_indptr - pre_indptr[0]
    new_locs = fb.out_cache_loc[:T].to("cpu", torch.int64)  # [T] slots of the new tokens
    kv_indptr, kv_indices = _interleave(pre_indptr, pre_indices, qo_indptr, new_locs)
    return Indices(kv_indptr, kv_indices, qo_indptr, B)


def _interleave(pre_indptr, pre_indices, qo_indptr, new_locs):
    """(kv_indptr, kv_indices): request b's prefix slots, then its new-token slots, for each b."""
    B = pre_indptr.shape[0] - 1
    parts, lens = [], []
    for b in range(B):
        p = pre_indices[int(pre_indptr[b]) : int(pre_indptr[b + 1])]
        n = new_locs[int(qo_indptr[b]) : int(qo_indptr[b + 1])]
        parts += [p, n]
        lens.append(p.numel() + n.numel())
    kv_indices = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)
    kv_indptr = torch.zeros(B + 1, dtype=torch.int64)
    kv_indptr[1:] = torch.cumsum(torch.tensor(lens, dtype=torch.int64), 0)
    return kv_indptr, kv_indices


def extend_kernel(ctx: CallContext, partials: bool) -> None:
    check_new_rows(ctx)


def check_new_rows(ctx: CallContext) -> None:
    """extend: the pool rows at the new tokens' slots must hold the ``k`` the kernel used."""
    k, k_buf, T = ctx.call.k, ctx.k_buf, ctx.q.shape[0]
    if k is None or k.dtype != k_buf.dtype or k.numel() != T * k_buf.shape[-1]:
        return  # k read back from the pool by the backend, or stored converted (fp8): nothing to check
    rows = gather_rows(k_buf, ctx.forward_batch.out_cache_loc[:T].long())  # [T, 1, D]
    if not torch.equal(rows.reshape(T, -1), k.reshape(T, -1)):
        raise Skip("extend: the pool does not hold this call's new K (written elsewhere or later)")


# ---------------------------------------------------------------------------------------------
# verify: speculative target_verify / draft_extend, the drafts' KV in the pool, a tree mask
# ---------------------------------------------------------------------------------------------


def verify_indices(ctx: CallContext) -> Indices:
    """Triton: the prefix from the metadata, then the drafts' slots (``out_cache_loc``), as extend;
    plus ``custom_mask`` / ``mask_indptr`` as the kernel read them. aiter: its metadata already
    covers ``seq_lens + draft_token_num`` (whole sequences) with ``qo_indptr``."""
    idx = aiter_verify_indices(ctx) if ctx.call.backend == "aiter" else prefix_and_new(ctx)
    qlen = idx.qo_indptr[1:] - idx.qo_indptr[:-1]
    lens = idx.kv_indptr[1:] - idx.kv_indptr[:-1]
    if bool((qlen > lens).any()) or bool((qlen < 1).any()):
        raise Skip("verify: a request with no query token or more queries than positions")
    read_mask(ctx, idx.qo_indptr, lens)
    return idx


def aiter_verify_indices(ctx: CallContext) -> Indices:
    md, T = ctx.md, ctx.q.shape[0]
    B = int(ctx.forward_batch.batch_size)
    qo = getattr(md, "qo_indptr", None)
    if qo is None or getattr(md, "kv_indices", None) is None or md.kv_indptr.shape[0] < B + 1:
        raise Skip("aiter verify metadata without qo_indptr / kv_indptr / kv_indices")
    qo_indptr = qo[: B + 1].to("cpu", torch.int64)
    if int(qo_indptr[-1] - qo_indptr[0]) != T:
        raise Skip(f"qo_indptr covers {int(qo_indptr[-1] - qo_indptr[0])} tokens, q has {T}")
    kv_indptr = md.kv_indptr[: B + 1].to("cpu", torch.int64)
    kv_indices = md.kv_indices[int(kv_indptr[0]) : int(kv_indptr[-1])].to("cpu", torch.int64)
    return Indices(kv_indptr - kv_indptr[0], kv_indices, qo_indptr - qo_indptr[0], B)


def read_mask(ctx: CallContext, qo_indptr: torch.Tensor, lens: torch.Tensor) -> None:
    """SGLang's ``custom_mask`` (request b's row-major [n_b, L_b] block at ``mask_indptr[b]``) to
    the host, checked against the indices; a chain without a mask (aiter) leaves both None."""
    mask, mptr = getattr(ctx.md, "custom_mask", None), getattr(ctx.md, "mask_indptr", None)
    if mask is None:
        spec = getattr(ctx.forward_batch, "spec_info", None)
        if int(getattr(spec, "topk", 1) or 1) > 1 and ctx.call.backend == "aiter":
            raise Skip("aiter verify with topk > 1: the kernel takes no tree mask, refmla cannot say what it saw")
        return
    if mptr is None:
        raise Skip("verify: custom_mask without mask_indptr")
    B = lens.shape[0]
    mptr = mptr[: B + 1].to("cpu", torch.int64)
    want = (qo_indptr[1:] - qo_indptr[:-1]) * lens  # [B] n_b * L_b
    if not torch.equal(mptr[1:] - mptr[:-1], want):
        raise Skip("verify: mask_indptr does not step by n * (prefix + n) per request")
    ctx.custom_mask = mask[int(mptr[0]) : int(mptr[-1])].to("cpu").bool()
    ctx.mask_indptr = mptr - mptr[0]


READERS: dict[str, ModeReader] = {
    "decode": ModeReader(indices=decode_indices, kernel=decode_kernel, meta=(triton_decode_meta, nvidia_meta)),
    "extend": ModeReader(indices=extend_indices, kernel=extend_kernel),
    "verify": ModeReader(indices=verify_indices, kernel=extend_kernel, meta=(verify_meta,)),
}
