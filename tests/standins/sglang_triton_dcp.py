"""A stand-in for SGLang 0.5.23's ``sglang.srt.layers.attention.triton_backend`` under decode context
parallelism, written from the real ``TritonAttnBackend.forward_decode``'s DCP branch.

What is real: the decode kernel (``sglang.kernels.ops.attention.decode_attention.decode_attention_fwd``,
on the Triton interpreter) and the combine (``sglang.srt.layers.dcp.comm.cp_lse_ag_out_rs_mha``),
both looked up in this module at call time, as the real module does. What stands in: the DCP
group (``group``: all_gather / all_reduce across ranks held in one process) and the metadata the
backend's ``init_forward_metadata`` would build. A test puts this module into ``sys.modules``
under the real name.
"""

from __future__ import annotations

import torch

from sglang.kernels.ops.attention.decode_attention import decode_attention_fwd
from sglang.srt.layers.dcp.comm import cp_lse_ag_out_rs_mha


class TritonAttnBackend:
    """forward_decode's DCP branch; ``last_partial``: the partial and lse this rank handed the combine
    (the test's bookkeeping for the other ranks' side of the group)."""

    def __init__(self, pool, forward_metadata, dcp_size, dcp_rank, group, max_kv_splits):
        self.token_to_kv_pool, self.forward_metadata = pool, forward_metadata
        self.dcp_size, self.dcp_rank, self.dcp_group, self.max_kv_splits = dcp_size, dcp_rank, group, max_kv_splits
        self.decode_attention_fwd = decode_attention_fwd  # the real one keeps it so (torch.compiler.disable)
        self.last_partial = None

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, sinks=None):
        md = self.forward_metadata
        group = self.dcp_group
        q_for_decode = q.view(-1, layer.tp_q_head_num, layer.qk_head_dim).contiguous()
        q_for_decode = group.all_gather(q_for_decode, dim=1).contiguous()
        o_for_decode = torch.empty((q_for_decode.shape[0], q_for_decode.shape[1], layer.v_head_dim),
                                   dtype=torch.float32, device=q.device)  # fmt: skip
        md.attn_lse.fill_(-float("inf"))
        self.decode_attention_fwd(
            q_for_decode, self.token_to_kv_pool.get_key_buffer(layer.layer_id),
            self.token_to_kv_pool.get_value_buffer(layer.layer_id), o_for_decode, md.kv_indptr, md.kv_indices,
            md.attn_logits, md.attn_lse, md.num_kv_splits, self.max_kv_splits, layer.scaling, 1.0, 1.0,
            logit_cap=0.0, sinks=None, xai_temperature_len=-1)  # fmt: skip
        local_lse = torch.logsumexp(md.attn_lse[: q_for_decode.shape[0], : q_for_decode.shape[1], :], dim=-1)
        self.last_partial = (o_for_decode.clone(), local_lse.clone())
        o = cp_lse_ag_out_rs_mha(o_for_decode, local_lse, group)
        return o.reshape(-1, layer.tp_q_head_num * layer.v_head_dim).to(q.dtype)
