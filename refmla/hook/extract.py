"""After the kernel: one call -> the capture's tensors + meta -> a file. Reads, never writes.

:func:`after` runs the stages in order; each reads a little more and may raise
:class:`~refmla.hook.call.Skip` (counted, logged once per reason), so that nothing is copied off
the device before the call is known to be capturable and the budget admits it:

1. :func:`open_call`: an absorbed-MLA call the capture format can describe (guards), q and out;
2. the mode reader's ``indices`` (:mod:`refmla.hook.modes`), then ``MIN_SEQ_LEN`` measured exactly;
3. :func:`read_pool`: the layer's KV buffer (guards) and the requests' ``req_to_token`` rows;
4. the mode reader's ``kernel``: Triton decode's split schedule and partials, extend's check;
5. the budget, from sizes alone (:meth:`HookState.admit`);
6. :func:`host_tensors`: the copy to host, the pool compacted to the referenced rows;
7. ``meta`` from the meta providers (:mod:`refmla.hook.meta`), then the atomic write.

The torch side of the hook: :mod:`refmla.hook.patching` imports this module on the first call
that passes the filters, never at start-up.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from refmla import blocktable
from refmla.hook import meta as meta_providers
from refmla.hook import nvidia, sglang_dcp
from refmla.hook.aiter_meta import aiter_buffers
from refmla.hook.call import Call, CallContext, Skip
from refmla.hook.modes import READERS
from refmla.hook.tensors import blank_empty_splits, gather_rows, referenced_rows, remap_req_to_token, row_tokens
from refmla.hook.writer import HookState, capture_name


def after(state: HookState, call: Call, backend_obj: Any, result: Any) -> None:
    """Capture one call whose kernel has run (``result`` is its output); see the module docstring."""
    ctx = open_call(call, backend_obj, result)
    cp = sglang_dcp.rank_call(ctx)  # decode context parallelism: the rank's partial, not the merged output
    reader = READERS[call.mode]
    ctx.idx = reader.indices(ctx)  # host, small
    ctx.seq_lens = (ctx.idx.kv_indptr[1:] - ctx.idx.kv_indptr[:-1]).to(torch.int32)  # [B] what the kernel attended
    if ctx.batch_size and int(ctx.seq_lens.max()) < state.cfg.min_seq_len:
        return  # below the threshold once measured exactly (the pre-check used the batch's lens)
    read_pool(ctx)
    if cp is not None:
        ctx.req_to_token = None  # its slots are the group's, not this rank's pool rows
    reader.kernel(ctx, state.cfg.partials and cp is None)
    rows = referenced_rows(ctx.idx.kv_indices, ctx.req_to_token, ctx.seq_lens, ctx.k_buf.shape[0])
    if ctx.block_table is not None:  # whole pages, the table renumbered (docs/contract.md, block tables)
        rows = page_rows(ctx)
    if not state.admit(estimate_bytes(ctx, rows)):
        return
    tensors = host_tensors(ctx, rows)
    tensors.update(row_tokens(getattr(call.forward_batch, "rids", None), ctx.seq_lens))  # what each row holds, when known
    meta = meta_providers.assemble(ctx, reader.meta)
    buffers, why_not = aiter_buffers(ctx)  # aiter's persistent work buffers, when small
    tensors.update(buffers)
    if why_not:
        meta["aiter_buffers"] = why_not
    if call.backend == "flashmla":  # the plan FlashMLA's decode read (refmla inspect checks it)
        plan, plan_meta = nvidia.flashmla_plan(getattr(ctx.md, "flashmla_metadata", None), getattr(ctx.md, "num_splits", None))
        if plan and plan["flashmla_num_splits"].shape[0] == ctx.batch_size + 1:
            tensors.update(plan)
            meta.update(plan_meta)
    backend = call.backend
    if cp is not None:
        tensors.update(cp["tensors"])
        meta.update(cp["meta"])
        backend = f"{backend}-dcp{meta['dcp_rank']}of{meta['dcp_world_size']}"
    name = capture_name(mode=call.mode, rank=call.rank, layer=call.layer_id, step=call.step,
                        backend=backend, pid=os.getpid())  # fmt: skip
    state.write(name, tensors, meta)


def _check_absorbed_mla(call: Call, backend_obj: Any, result: Any, D: int, Dv: int, kv_lora_rank: int) -> None:
    """Skip what ``refmla.capture/1`` cannot describe: MHA, sliding window, DCP off the Triton decode, sinks, no output."""
    layer = call.layer
    if Dv != kv_lora_rank or D <= Dv or int(getattr(layer, "tp_k_head_num", 1)) != 1:
        raise Skip(f"not an absorbed-MLA call (qk_head_dim={D}, v_head_dim={Dv}, kv_lora_rank={kv_lora_rank})")
    sw = getattr(layer, "sliding_window_size", None)
    if sw is not None and sw > -1:
        raise Skip("sliding-window layer")
    sglang_dcp.check_dcp_call(call, backend_obj)  # DCP: the Triton decode's rank calls only
    if call.sinks is not None or (getattr(layer, "xai_temperature_len", -1) or -1) > 0:
        raise Skip("attention sinks / xai temperature are not in refmla.capture/1")
    if call.llama_4_scaling is not None:
        raise Skip("llama 4 query scaling is not in refmla.capture/1")
    if call.q is None or result is None or not torch.is_tensor(result):
        raise Skip("no q or no output tensor")


def open_call(call: Call, backend_obj: Any, result: Any) -> CallContext:
    """The call's geometry and q / out views, after the guards of :func:`_check_absorbed_mla`."""
    layer = call.layer
    md = nvidia.metadata(call.backend, backend_obj, call.forward_batch)
    if md is None:
        raise Skip("backend has no forward_metadata")
    H = int(layer.tp_q_head_num)
    D = int(layer.qk_head_dim)
    Dv = int(layer.v_head_dim)
    pool = backend_obj.token_to_kv_pool
    kv_lora_rank = int(getattr(pool, "kv_lora_rank", Dv))
    _check_absorbed_mla(call, backend_obj, result, D, Dv, kv_lora_rank)
    q = nvidia.full_query(call.q, call.q_rope, H, D, Dv)  # [B, H, D] decode / [T, H, D] extend; never written
    out = result.reshape(-1, H, Dv)  # [B, H, Dv] / [T, H, Dv]
    if out.shape[0] != q.shape[0]:
        raise Skip(f"output rows {out.shape[0]} != query rows {q.shape[0]}")
    return CallContext(call=call, backend=backend_obj, md=md, pool=pool, heads=H, qk_head_dim=D,
                       kv_lora_rank=kv_lora_rank, q=q, out=out)  # fmt: skip


def read_pool(ctx: CallContext) -> None:
    """``ctx.k_buf`` (the layer's [N, 1, D] buffer, checked against kv_indices) and ``ctx.req_to_token``."""
    D, B, kv_indices = ctx.qk_head_dim, ctx.batch_size, ctx.idx.kv_indices
    k_buf = ctx.pool.get_key_buffer(ctx.layer.layer_id)  # [N, 1, D]; read only
    if k_buf.dim() != 3 or k_buf.shape[1] != 1 or k_buf.shape[2] != D:
        raise Skip(f"KV pool buffer shape {list(k_buf.shape)} is not [N, 1, {D}]")
    N = k_buf.shape[0]
    if kv_indices.numel() and (int(kv_indices.min()) < 0 or int(kv_indices.max()) >= N):
        raise Skip("kv_indices out of the pool's range")
    ctx.k_buf = k_buf
    r2t_src = getattr(ctx.backend, "req_to_token", None)
    rpi = getattr(ctx.forward_batch, "req_pool_indices", None)
    if r2t_src is not None and rpi is not None and rpi.shape[0] >= B and B:
        M = int(ctx.seq_lens.max())
        ctx.req_to_token = r2t_src[:, :M].index_select(0, rpi[:B].to(r2t_src.device).long()).to("cpu")


def page_rows(ctx: CallContext) -> torch.Tensor:
    """Every row of every in-pool page the block table names, padding included, sorted [K * P]."""
    P = int(ctx.page_size)
    kept, _ = blocktable.compact_pages(ctx.block_table, P, ctx.k_buf.shape[0])  # [K]
    return (kept[:, None] * P + torch.arange(P)).flatten()


def estimate_bytes(ctx: CallContext, rows: torch.Tensor) -> int:
    """The capture's size from tensor sizes alone (before anything is copied), + 4 KiB of header."""
    q, out, k_buf, n_idx, B = ctx.q, ctx.out, ctx.k_buf, ctx.idx.kv_indices.numel(), ctx.batch_size
    partials = ctx.attn_logits.numel() * 4 + ctx.attn_lse.numel() * 4 if ctx.attn_logits is not None else 0
    return (q.numel() * q.element_size() + out.numel() * out.element_size()
            + rows.numel() * ctx.qk_head_dim * k_buf.element_size() + 8 * (3 * n_idx + 3 * B + 2)
            + (ctx.req_to_token.numel() * 8 if ctx.req_to_token is not None else 0)
            + partials + (ctx.custom_mask.numel() if ctx.custom_mask is not None else 0) + 4096)  # fmt: skip


def host_tensors(ctx: CallContext, rows: torch.Tensor) -> dict[str, torch.Tensor]:
    """The capture's tensors on the host (reads only); the pool compacted to ``rows``."""
    idx = ctx.idx
    tensors = {
        "q": ctx.q.detach().to("cpu"),
        "kv_buffer": gather_rows(ctx.k_buf, rows).to("cpu"),  # only the referenced rows
        "kv_indptr": idx.kv_indptr,
        "kv_indices": torch.searchsorted(rows, idx.kv_indices),
        "orig_kv_indices": idx.kv_indices,
        "seq_lens": ctx.seq_lens,
        "out": ctx.out.detach().to("cpu"),
    }
    if ctx.block_table is not None:  # renumbered to the pages page_rows kept
        _, tensors["block_table"] = blocktable.compact_pages(ctx.block_table, ctx.page_size, ctx.k_buf.shape[0])
    if ctx.req_to_token is not None:
        tensors["req_to_token"] = remap_req_to_token(ctx.req_to_token, rows, ctx.seq_lens)
    if idx.qo_indptr is not None:
        tensors["qo_indptr"] = idx.qo_indptr
    if ctx.num_kv_splits is not None:
        tensors["num_kv_splits"] = ctx.num_kv_splits
    if ctx.custom_mask is not None:
        tensors["custom_mask"], tensors["mask_indptr"] = ctx.custom_mask, ctx.mask_indptr
    if ctx.attn_logits is not None:
        al = ctx.attn_logits.detach().to("cpu", torch.float32).clone()
        ae = ctx.attn_lse.detach().to("cpu", torch.float32).clone()
        blank_empty_splits(al, ae, ctx.seq_lens, ctx.num_kv_splits)
        tensors["attn_logits"], tensors["attn_lse"] = al, ae
    return tensors
