"""STAND-IN for aiter's Gluon MLA decode (tests only). Not a kernel.

``mla_gluon`` with the signature of aiter's: checks the 1-D (kv_indices / kv_indptr) calling
convention SGLang 0.5.23's ``mla_gluon_decode`` uses (q split into nope [B, H, Dv] and rope
[B, H, D - Dv], one shared kv_c [N, D] buffer with k_pe None and kv_pe_offset = Dv, at most 16
heads: the bh16 regimes), records the call in GLUON_CALLS and writes the reference result into o.
"""

from __future__ import annotations

import torch

from aiter.ops.attention import ContractViolation
from refmla import reference as ref
from refmla.attended import Attended
from refmla.scales import Scales

GLUON_CALLS: list[dict] = []


def _need(ok: bool, what: str) -> None:
    if not ok:
        raise ContractViolation(what)


def mla_gluon(q_nope, q_pe, kv_c, o, page_table, seq_info, sm_scale, k_pe=None, kv_pe_offset=512, use_2d_view=True,
              kv_scale=1.0, min_kv_seq_len=1, return_lse=False, has_pe=True, attn_sink=None):  # fmt: skip
    _need(q_nope.dim() == 3 and q_pe.dim() == 3, "decode: q_nope / q_pe must be [B, H, *]")
    B, H, Dv = q_nope.shape
    D = Dv + q_pe.shape[2]
    assert H <= 16, f"mla_gluon: {H} heads, the bh16 regimes take at most 16"  # aiter asserts its regimes
    _need(kv_c.dim() == 2 and kv_c.shape[1] == D, f"kv_c must be [N, {D}] (shared nope + rope), got {list(kv_c.shape)}")
    _need(k_pe is None and kv_pe_offset == Dv, f"shared buffer: k_pe None and kv_pe_offset {Dv}, got {kv_pe_offset}")
    _need(not use_2d_view, "SGLang passes 1-D kv_indices / kv_indptr: use_2d_view must be False")
    _need(page_table.dtype == torch.int32 and page_table.dim() == 1, "page_table must be 1-D int32 kv_indices")
    _need(seq_info.dtype == torch.int32 and seq_info.shape == (B + 1,), "seq_info must be int32 kv_indptr [B + 1]")
    _need(o.shape == (B, H, Dv), f"o must be [{B}, {H}, {Dv}], got {list(o.shape)}")
    _need(isinstance(kv_scale, float), f"kv_scale must be a float, got {type(kv_scale).__name__}")
    _need(isinstance(min_kv_seq_len, int) and min_kv_seq_len >= 1, f"min_kv_seq_len {min_kv_seq_len!r}")
    _need(isinstance(sm_scale, float) and sm_scale > 0, f"sm_scale {sm_scale!r}")
    GLUON_CALLS.append({"fn": "mla_gluon", "heads": H, "B": B, "kv_scale": kv_scale, "min_kv_seq_len": min_kv_seq_len})
    q = torch.cat([q_nope, q_pe], dim=-1)  # [B, H, D]
    out, lse = ref.mla_decode_ref(q.cpu(), kv_c.reshape(-1, 1, D).cpu(), Attended.token_index(seq_info.long().cpu(), page_table.long().cpu()), Scales(kv_lora_rank=Dv, sm_scale=sm_scale, k_scale=kv_scale, v_scale=kv_scale))  # fmt: skip
    o.copy_(out.to(o.dtype))
    return (o, lse.float()) if return_lse else o
