"""After vLLM's ``forward_mqa`` ran: the kernel's inputs and output -> a block-table capture.

Reads, never writes. The capture describes the kernel call itself: for TRITON_MLA's multi-token
decode (several query rows per request) the rows' block-table rows and causal extents exactly as
``forward_mqa`` expands them, with ``query_start_loc`` saying which rows belong to which request;
the split count it chose (``_compute_num_kv_splits`` of its module, one batch-wide constexpr
count, uniform splits: meta ``split_schedule: "uniform"``). The pool is copied page by page, only
the pages the block table names (refmla.capture.write compacts further). Recorded in meta: which
vLLM backend ran, its page size, the dtypes, and the scales the kernel got (forward_mqa passes
``layer._k_scale`` as both K and V scale; ``layer._v_scale`` is noted as ``vllm_v_scale``). The
returned lse is stored only when fp32: TRITON_MLA returns it in q's dtype (bf16), rounded past
what the format's lse means; meta ``lse_dtype`` says which it was.

Under decode context parallelism (``dcp_world_size`` > 1) the call is one rank's: its kernel
attends its shard of each request (the local lengths in ``decode.seq_lens``). The capture adds the
geometry (meta ``dcp_world_size``, ``dcp_rank``, ``dcp_interleave_size``, ``dcp_tot_seq_lens``) and
keeps every page of the shard, so ``refmla replay`` rebuilds the whole context from the ranks'
captures (docs/context-parallel.md). Where the layer has vLLM's DCP manager, the capture is held
until its combine has run and written with the combine's inputs and output (refmla.hook.dcp_combine).
"""

from __future__ import annotations

import os
from typing import Any, Optional

import torch

from refmla import blocktable
from refmla.capture import dcp
from refmla.hook import dcp_combine
from refmla.hook.call import Skip, VllmCall
from refmla.hook.nvidia import flashmla_plan
from refmla.hook.writer import HookState, capture_name


def after(state: HookState, call: VllmCall, impl: Any, inputs: tuple, result: Any, installed: Optional[list] = None) -> None:
    """``installed``: the installation's (owner, name, original) list, where a DCP combine's wrapper
    is recorded for uninstall (refmla.hook.dcp_combine)."""
    q, cache, md = inputs
    out, lse = _outputs(result)
    q = torch.cat(q, dim=-1) if isinstance(q, tuple) else q  # [B, H, D]
    decode = getattr(md, "decode", None)
    if decode is None or cache is None or cache.dim() != 3:
        raise Skip("no decode metadata or a KV cache that is not [blocks, page, D]")
    table, seq, qsl = kernel_rows(impl, md, q.shape[0], call.engine_backend)
    cp = dcp_meta(impl, md, qsl)  # decode context parallelism: this rank's shard of each request
    if int(seq.max() if seq.numel() else 0) < state.cfg.min_seq_len:
        return
    P = int(cache.shape[1])
    shard = seq if cp is None else torch.maximum(seq.long(), _shard_lens(cp, seq))  # the rows the rank holds, too
    pages = torch.unique(_used_pages(table, shard, P))  # [K] the pages the sequences read
    est = q.numel() * q.element_size() * 2 + pages.numel() * P * cache.shape[2] * cache.element_size() + 4096
    if not state.admit(est):
        return
    tensors = host_tensors(q, out, lse, cache, table, seq, qsl, pages)
    splits = num_kv_splits(impl, md, call.engine_backend)
    if splits is not None:
        tensors["num_kv_splits"] = torch.full((q.shape[0],), splits, dtype=torch.int32)
    meta = capture_meta(call, impl, q, cache, splits)
    meta.update(cp or {})
    if call.engine_backend == "FLASHMLA":  # the plan its decode read (refmla inspect checks it)
        fp8 = str(getattr(impl, "kv_cache_dtype", "auto")).startswith("fp8")  # vLLM's fp8 path: the tensor API's rows
        plan, plan_meta = flashmla_plan(getattr(decode, "scheduler_metadata", None), None, "block" if fp8 else "struct")
        if plan and plan["flashmla_num_splits"].shape[0] == q.shape[0] + 1:
            tensors.update(plan)
            meta.update(plan_meta)
    if lse is not None:
        meta["lse_dtype"] = str(lse.dtype).replace("torch.", "")
    backend = call.backend if cp is None else f"{call.backend}-dcp{cp['dcp_rank']}of{cp['dcp_world_size']}"
    name = capture_name(mode="decode", rank=call.rank, layer=call.layer_id, step=call.step, backend=backend,
                        pid=os.getpid())  # fmt: skip
    if cp is not None and dcp_combine.hold(state, call.layer, name, tensors, meta, installed):
        return  # written when the layer's DCP combine has run, with its inputs and output (refmla.hook.dcp_combine)
    state.write(name, tensors, meta)


def dcp_meta(impl: Any, md: Any, qsl: Any) -> Optional[dict]:
    """The meta of a rank's call under decode context parallelism (docs/context-parallel.md), None
    without it: world size and rank (the impl's), the interleave (vLLM's parallel config's
    ``cp_kv_cache_interleave_size``), each request's whole length (``decode.dcp_tot_seq_lens``).
    What cannot be read is a Skip naming it: a rank's capture without its geometry is no use."""
    W = int(getattr(impl, "dcp_world_size", 1) or 1)
    if W <= 1:
        return None
    if qsl is not None:
        raise Skip("multi-token decode under decode context parallelism is not captured")
    I = _interleave(impl, md)
    tot = getattr(md.decode, "dcp_tot_seq_lens", None)
    if I is None or not torch.is_tensor(tot):
        raise Skip("decode context parallelism without its interleave size or dcp_tot_seq_lens")
    return {"dcp_world_size": W, "dcp_rank": int(impl.dcp_rank), "dcp_interleave_size": I,
            "dcp_tot_seq_lens": [int(v) for v in tot.to("cpu").tolist()],
            "lse_base": "ln" if getattr(impl, "lse_base_on_e", True) else "log2"}  # fmt: skip  (what the combine reads)


def _interleave(impl: Any, md: Any) -> Optional[int]:
    for holder in (md, getattr(md, "decode", None), impl):
        v = getattr(holder, "cp_kv_cache_interleave_size", None)
        if v is not None:
            return int(v)
    try:
        from vllm.config import get_current_vllm_config_or_none

        config = get_current_vllm_config_or_none()
        v = getattr(getattr(config, "parallel_config", None), "cp_kv_cache_interleave_size", None)
        return None if v is None else int(v)
    except Exception:
        return None


def _shard_lens(cp: dict, seq: torch.Tensor) -> torch.Tensor:
    """The rows the rank's shard holds of each request (the geometry's local lengths)."""
    tot = torch.tensor(cp["dcp_tot_seq_lens"], dtype=torch.int64)
    return dcp.local_lens(tot, cp["dcp_world_size"], cp["dcp_rank"], cp["dcp_interleave_size"]).to(seq.device)


def _outputs(result: Any) -> tuple[torch.Tensor, Any]:
    out, lse = (tuple(result) + (None, None))[:2] if isinstance(result, tuple) else (result, None)
    if not torch.is_tensor(out) or out.dim() != 3:
        raise Skip("forward_mqa returned no [B, H, Dv] output")
    return out, lse if torch.is_tensor(lse) else None


def kernel_rows(impl: Any, md: Any, rows: int, engine_backend: str) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """(block_table [R, M], seq_lens [R], query_start_loc or None) as the kernel read them."""
    table, seq = md.decode.block_table, md.decode.seq_lens
    n = int(seq.shape[0])
    q_len, rem = divmod(rows, n) if n else (1, 0)
    if rem:
        raise Skip(f"non-uniform decode block: {rows} query rows over {n} requests")
    if q_len == 1:
        return table, seq, None
    if engine_backend != "TRITON_MLA":
        raise Skip(f"multi-token decode of {engine_backend} is not captured (per-row layout known for TRITON_MLA)")
    table = table.repeat_interleave(q_len, dim=0)
    if getattr(md, "causal", True):  # forward_mqa: row t sees the prefix plus block tokens 0..t
        offsets = torch.arange(1 - q_len, 1, device=seq.device, dtype=seq.dtype)
        seq = (seq.unsqueeze(1) + offsets).flatten().clamp(min=0)
    else:
        seq = seq.repeat_interleave(q_len)
    return table, seq, torch.arange(0, rows + 1, q_len, dtype=torch.int32)


def _used_pages(table: torch.Tensor, seq: torch.Tensor, P: int) -> torch.Tensor:
    need = (seq.long() + P - 1) // P  # [R]
    cols = torch.arange(table.shape[1], device=table.device)
    used = table.long()[cols[None, :] < need[:, None]]
    return used.clamp(min=0).cpu()


def host_tensors(q, out, lse, cache, table, seq, qsl, pages) -> dict[str, torch.Tensor]:
    """The capture's tensors on the host: only the named pages of the pool, the table renumbered."""
    P, D = int(cache.shape[1]), int(cache.shape[2])
    pages = pages[pages < cache.shape[0]]  # a page past the pool is left out; validation names it
    pool = cache.index_select(0, pages.to(cache.device)).reshape(-1, 1, D).to("cpu")  # [K * P, 1, D]
    host_table = table.to("cpu").long()
    renum = torch.searchsorted(pages, host_table.clamp(min=0))
    hit = renum < pages.numel()
    hit[hit.clone()] = pages[renum[hit]] == host_table[hit]
    host_seq = seq.to("cpu", torch.int32)
    tensors = {
        "q": q.detach().to("cpu"), "kv_buffer": pool, "seq_lens": host_seq,
        "block_table": torch.where(hit, renum, -1).to(torch.int32), "out": out.detach().to("cpu"),
        "orig_kv_indices": blocktable.token_rows(host_table, host_seq, P)[1],  # production pool rows
    }  # fmt: skip
    if lse is not None and lse.shape == out.shape[:2] and lse.dtype == torch.float32:
        tensors["lse"] = lse.detach().to("cpu")  # a narrower lse is not the format's (meta lse_dtype)
    if qsl is not None:
        tensors["query_start_loc"] = qsl
    return tensors


def num_kv_splits(impl: Any, md: Any, engine_backend: str):
    """TRITON_MLA's batch-wide split count as forward_mqa computes it, else None."""
    if engine_backend != "TRITON_MLA":
        return None
    import importlib

    mod = importlib.import_module(type(impl).__module__)
    try:
        import vllm.envs as envs

        if getattr(envs, "VLLM_BATCH_INVARIANT", False):
            return 1
    except Exception:
        pass
    rule = getattr(mod, "_compute_num_kv_splits", None)
    return int(rule(int(md.max_seq_len), int(impl._sm_count))) if rule is not None else None


def capture_meta(call: VllmCall, impl: Any, q: torch.Tensor, cache: torch.Tensor, splits) -> dict[str, Any]:
    layer, Dv = call.layer, int(impl.kv_lora_rank)
    k_scale = float(getattr(layer, "_k_scale_float", 1.0))
    meta = {
        "mode": "decode", "backend": call.backend, "engine": "vllm", "engine_backend": call.engine_backend,
        "engine_version": _vllm_version(), "kv_lora_rank": Dv, "qk_rope_head_dim": int(q.shape[-1]) - Dv,
        "sm_scale": float(impl.scale), "logit_cap": 0.0, "page_size": int(cache.shape[1]),
        "k_scale": k_scale, "v_scale": k_scale, "layer_id": call.layer_id, "tp_rank": call.rank, "step": call.step,
        "null_block": 0, "kv_cache_dtype": str(getattr(impl, "kv_cache_dtype", "auto")),
        "q_dtype": str(q.dtype).replace("torch.", ""), "kv_dtype": str(cache.dtype).replace("torch.", ""),
        "vllm_v_scale": float(getattr(layer, "_v_scale_float", 1.0)),
    }  # fmt: skip
    if splits is not None:
        meta.update(split_schedule="uniform", max_kv_splits=int(splits))
    return meta


def _vllm_version() -> str:
    try:
        from importlib.metadata import version

        return version("vllm")
    except Exception:
        return "unknown"


__all__ = ["after", "capture_meta", "host_tensors", "kernel_rows", "num_kv_splits"]
