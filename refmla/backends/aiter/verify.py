"""aiter's MLA decode kernel on a verify capture: ``mla_decode_fwd`` with ``max_seqlen_q > 1``.

How SGLang's ``AiterAttnBackend`` calls it in ``target_verify`` (``init_forward_metadata``,
``forward_mode.is_target_verify()``) and how refmla replays it:

    q            [T, Hk, 576]   T = B * draft_token_num, heads padded as for decode (pad_heads)
    qo_indptr    [B + 1] int32  the capture's: steps of draft_token_num in SGLang
    kv_indptr    [B + 1] int32  over seq_lens + draft_token_num (the capture's seq_lens hold the drafts)
    kv_indices   int32          token slots (page size 1, as SGLang passes them) or page ids
                                (page-level when ``opts.aiter_page_size`` asks, refmla.paged)
    max_seqlen_q                the largest query count (draft_token_num)

aiter applies the causal bottom-right mask inside the request itself; it has no tree mask, so a
verify capture with ``custom_mask`` whose drafts are not a chain is refused (skipped, with why).
The decode call (``refmla.backends.aiter``) is reused as is; this module only swaps the
query-side arguments, so the ``aiter`` backend name serves decode and verify alike. It replays the
non-persistent call; SGLang may have run the persistent (``_mla_decode_fwd_with_head_pad``) or
gluon verify path in production -- ``info.path`` says ``non_persistent``.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from refmla.backends.aiter.backend import AiterBackend
from refmla.backends.aiter.heads import pad_heads
from refmla.backends.aiter.indices import aiter_decode_args, call_kernel, kernel_kwargs, output_buffer
from refmla.backends.aiter.probe import locate_aiter
from refmla.backends.base import BackendResult, BackendUnavailable
from refmla.capture import Capture
from refmla.options import ReplayOptions


def is_chain(cap: Capture) -> bool:
    """Whether the capture's mask (if any) is the causal bottom-right one on every request."""
    att = cap.attended()
    return not att.has_mask or att.is_bottom_right_causal()


def run_aiter_verify(cap: Capture, page_size: int, out_dtype: torch.dtype, device: Optional[str] = None,
                     fill: Optional[float] = None) -> tuple[torch.Tensor, dict]:  # fmt: skip
    """mla_decode_fwd with max_seqlen_q > 1 over the capture: out [T, H, Dv] (CPU) and info."""
    mla, version, standin = locate_aiter()
    fn, m = mla.mla_decode_fwd, cap.meta
    dev = torch.device(device or ("cpu" if standin else "cuda"))
    fp8 = cap.kv_buffer.dtype.itemsize == 1
    if (fp8 and m.k_scale != m.v_scale) or (not fp8 and (m.k_scale != 1.0 or m.v_scale != 1.0)):
        raise BackendUnavailable(f"aiter takes one kv_scale (fp8 only); capture has k_scale {m.k_scale}, v_scale {m.v_scale}")
    q_in, unpad, pad_how = pad_heads(cap.q.to(dev).contiguous())  # [T, Hk, D]
    args, convention = aiter_decode_args(q_in, cap.kv_buffer, cap.kv_indptr, cap.kv_indices, page_size=page_size,
                                         device=dev)  # fmt: skip
    qo = cap.qo_indptr.to(dev, torch.int32).contiguous()
    qlens = (qo[1:] - qo[:-1]).cpu()
    max_q = int(qlens.max()) if qlens.numel() else 1
    B = cap.batch_size
    args.update(qo_indptr=qo, max_seqlen_q=max_q, kv_last_page_lens=args["kv_last_page_lens"][:B])
    o = output_buffer((q_in.shape[0], q_in.shape[1], m.kv_lora_rank), out_dtype, dev, fill)  # [T, Hk, Dv]
    scale = torch.tensor([float(m.k_scale)], dtype=torch.float32, device=dev) if fp8 else None
    values = dict(q=q_in, o=o, sm_scale=float(m.sm_scale), logit_cap=float(m.logit_cap), q_scale=scale,
                  kv_scale=scale, **args)  # fmt: skip
    kwargs = kernel_kwargs(fn, values)
    seconds = call_kernel(fn, kwargs, dev)
    info: dict[str, Any] = {
        "aiter_version": version, "kernel": "aiter.mla.mla_decode_fwd", "stand_in": standin, "device": str(dev),
        "path": "non_persistent", "max_seqlen_q": max_q, "query_lengths": sorted(set(qlens.tolist())), "index_convention": convention,
        "page_size": args["page_size"], "head_padding": pad_how, "kernel_heads": int(q_in.shape[1]),
        "kernel_params": sorted(kwargs), "kernel_seconds": seconds,
    }  # fmt: skip
    if len(set(qlens.tolist())) > 1:
        info["note"] = "query lengths differ across requests; SGLang's target_verify always passes one draft_token_num"
    return unpad(o).cpu(), info


class AiterVerifyBackend(AiterBackend):
    """The ``aiter`` backend: decode as :class:`AiterBackend`, verify through :func:`run_aiter_verify`."""

    def run(self, cap: Capture, opts: ReplayOptions) -> BackendResult:
        if not cap.is_verify:
            return super().run(cap, opts)
        ok, why = self.availability()
        if not ok:
            raise BackendUnavailable(why)
        if not is_chain(cap):
            raise BackendUnavailable("aiter's mla_decode_fwd has no tree mask: a topk > 1 verify is not an aiter call")
        # token level (page size 1), as SGLang's target_verify passes K_Buffer.view(-1, 1, 1, D);
        # opts.aiter_page_size asks for aiter's page-level convention instead
        P = int(opts.aiter_page_size or 1)
        try:
            out, info = run_aiter_verify(cap, P, cap.out_dtype, opts.device, opts.buffer_fill)
        except AssertionError as e:  # aiter asserts what it does not support (logit_cap > 0, head counts)
            raise BackendUnavailable(f"aiter refused this input: {e}") from None
        return BackendResult(out=out, info=info)


__all__ = ["AiterVerifyBackend", "is_chain", "run_aiter_verify"]
