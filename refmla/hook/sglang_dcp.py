"""(torch) SGLang's Triton decode under decode context parallelism: one rank's call as a rank capture.

Under DCP (``backend.dcp_size`` > 1) SGLang's ``TritonAttnBackend.forward_decode`` gathers the
group's query heads (``all_gather(q, dim=1)``), runs the decode kernel over the rank's shard (the
metadata's ``kv_indptr`` / ``kv_indices``, built by ``create_triton_kv_indices_for_dcp_triton``:
position p of a request on rank p % W, its slot ``req_to_token[p] // W``), takes each head's
natural lse over the splits, and merges the ranks inside the call (``cp_lse_ag_out_rs_mha``: the
partials scaled by exp(lse - logsumexp), all-reduced, this rank's heads kept). What forward_decode
returns is the merged output, so the capture takes what the kernel probes saw
(:mod:`refmla.hook.kernel_probes`): the gathered q the kernel got, the pre-merge partial and lse
the combine was handed (``out``, ``lse``, and again as ``dcp_in_out`` / ``dcp_in_lse``), and the
combine's output (``dcp_out``). The geometry: W and the rank from the backend, interleave 1 (the
token-interleaved layout of SGLang's generic DCP paths), the whole lengths from
``forward_batch.seq_lens``.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from refmla.hook.call import CallContext, Skip


def dcp_size(backend: Any) -> int:
    return int(getattr(backend, "dcp_size", 1) or 1)


def check_dcp_call(call: Any, backend: Any) -> None:
    """Skip a DCP call this module cannot describe (another backend or mode than Triton decode)."""
    if max(dcp_size(backend), int(getattr(backend, "dcp_world_size", 1) or 1)) > 1:
        if call.backend != "triton" or call.mode != "decode":
            raise Skip(f"decode context parallelism on {call.backend} {call.mode}: captured on the Triton decode only")


def rank_call(ctx: CallContext) -> Optional[dict]:
    """Under DCP: ctx's q / out / heads set to what the kernel and the combine saw, the rank's meta
    and combine tensors returned ({"meta": ..., "tensors": ...}); None without DCP."""
    W = dcp_size(ctx.backend)
    if W <= 1:
        return None
    seen = ctx.call.kernel_notes or {}
    q, part, lse, merged = (seen.get(k) for k in ("kernel_q", "dcp_in_out", "dcp_in_lse", "dcp_out"))
    if any(not torch.is_tensor(t) for t in (q, part, lse, merged)):
        raise Skip("decode context parallelism: the gathered q or the combine was not seen (Lean kernel or another path)")
    B = ctx.q.shape[0]
    q, part, lse = q.reshape(q.shape[0], -1, ctx.qk_head_dim)[:B], part[:B], lse[:B]
    HW = q.shape[1]
    if part.shape != (B, HW, ctx.kv_lora_rank) or lse.shape != (B, HW) or merged.dim() != 3:
        raise Skip(f"decode context parallelism: q {list(q.shape)}, partial {list(part.shape)}, lse {list(lse.shape)}: not one call's")
    world, rank = seen.get("dcp_group") or (W, int(getattr(ctx.backend, "dcp_rank", 0)))
    tot = getattr(ctx.forward_batch, "seq_lens_cpu", None)
    tot = tot if torch.is_tensor(tot) else getattr(ctx.forward_batch, "seq_lens", None)
    if not torch.is_tensor(tot) or tot.shape[0] < B:
        raise Skip("decode context parallelism without the whole lengths (forward_batch.seq_lens)")
    ctx.q, ctx.out, ctx.heads = q, part, HW
    meta = {"dcp_world_size": int(world), "dcp_rank": int(rank), "dcp_interleave_size": 1,
            "dcp_tot_seq_lens": [int(v) for v in tot[:B].to("cpu").tolist()], "lse_base": "ln",
            "dcp_combine": "cp_lse_ag_out_rs_mha", "dcp_source": "sglang_pre_merge"}  # fmt: skip
    host = lse.detach().to("cpu", torch.float32)
    tensors = {"lse": host, "dcp_in_out": part.detach().to("cpu").clone(), "dcp_in_lse": host.clone(),
               "dcp_out": merged[:B].detach().to("cpu").clone()}  # fmt: skip
    return {"meta": meta, "tensors": tensors}


__all__ = ["check_dcp_call", "dcp_size", "rank_call"]
