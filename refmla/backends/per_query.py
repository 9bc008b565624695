"""The plain-decode path over a verify capture's KV: each verify query as a one-token decode.

Query i of request b (n query tokens, L positions, the drafts the last n) becomes its own
decode request over exactly the positions it sees -- causal: the prefix and drafts 0..i,
``kv_indices[kv_indptr[b] : kv_indptr[b] + L - n + i + 1]``; a tree: the positions its mask
row marks. Over the same pool rows, the decode kernel must give the verify output: where the
verify path diverges and this one agrees (or the other way round), the seed's question -- "MTP
verify is fine, plain decode is not, over the same KV" -- has its answer (refmla.diagnosis).

    triton_decode_per_query   SGLang's Triton decode kernel (refmla.backends.triton), split
                              schedule: SGLang's get_num_kv_splits for the per-query lengths
    aiter_decode_per_query    aiter's mla_decode_fwd with max_seqlen_q = 1 (refmla.backends.aiter)

Both run on verify captures only; a decode capture is its own plain decode (``triton``, ``aiter``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from refmla.attended import Attended
from refmla.backends import triton_interp
from refmla.backends.aiter import AiterCall, aiter_status, run_aiter_decode
from refmla.backends.base import Backend, BackendResult, BackendUnavailable
from refmla.backends.calling import KernelSignatureError
from refmla.backends.triton import TritonBackend, TritonLaunch, run_triton_decode
from refmla.capture import Capture
from refmla.control import mla_control_split
from refmla.options import ReplayOptions
from refmla.schedule import default_num_kv_splits, mla_max_kv_splits


@dataclass
class PerQueryBatch:
    """A verify capture as T one-token decode requests over the same pool."""

    q: torch.Tensor  # [T, H, D] the capture's q, one row per decode request
    kv_indptr: torch.Tensor  # [T + 1] int64
    kv_indices: torch.Tensor  # [sum of visible lengths] pool rows, position order
    lens: torch.Tensor  # [T] positions each query sees
    att: Attended  # the same as a decode layout: query t reads all of group t


def per_query_batch(cap: Capture) -> PerQueryBatch:
    """Each query token of a verify capture as a decode request over the positions it sees."""
    if not cap.is_verify:
        raise BackendUnavailable(f"verify captures only; a {cap.meta.mode} capture is replayed by triton / aiter")
    att = cap.attended()
    parts = [att.rows_seen(t) for t in range(att.num_rows)]  # [L_t] each
    lens = torch.tensor([len(p) for p in parts], dtype=torch.int64)
    indptr = torch.zeros(len(parts) + 1, dtype=torch.int64)
    indptr[1:] = torch.cumsum(lens, 0)
    indices = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)
    return PerQueryBatch(cap.q, indptr, indices, lens, Attended.token_index(indptr, indices))


def _what(cap: Capture, batch: PerQueryBatch) -> dict:
    return {
        "per_query": "each verify query as a one-token decode over the positions it sees "
                     + ("(its tree mask row)" if cap.attended().has_mask else "(prefix + drafts 0..i)"),
        "decode_requests": int(batch.lens.shape[0]),
    }  # fmt: skip


class TritonDecodePerQueryBackend(Backend):
    name = "triton_decode_per_query"

    def availability(self) -> tuple[bool, str]:
        return TritonBackend().availability()

    def run(self, cap: Capture, opts: ReplayOptions) -> BackendResult:
        batch = per_query_batch(cap)
        ok, why = self.availability()
        if not ok:
            raise BackendUnavailable(why)
        m = cap.meta
        cu = opts.cu_count
        max_kv = m.max_kv_splits or mla_max_kv_splits(cu)
        splits = default_num_kv_splits(batch.lens.to(torch.int32), max_kv_splits=max_kv, num_heads=cap.num_heads,
                                       cu_count=cu)  # fmt: skip
        dev = "cpu" if triton_interp.interpreter_active() else (opts.device or "cuda")
        if dev == "cpu" and triton_interp.over_budget(cap):
            raise BackendUnavailable(triton_interp.over_budget(cap))
        try:
            out, _, _, info = run_triton_decode(
                batch.q.to(dev), cap.kv_buffer.to(dev), batch.kv_indptr, batch.kv_indices, splits, cap.scales(),
                TritonLaunch(max_kv_splits=max_kv, trim=opts.trim, out_dtype=cap.out_dtype),
            )  # fmt: skip
        except KernelSignatureError as e:
            raise BackendUnavailable(str(e)) from e
        info.update(_what(cap, batch), num_kv_splits_source=f"SGLang's get_num_kv_splits for the per-query "
                    f"lengths (cu_count={cu}, max_kv_splits={max_kv})",
                    control="split-aware: fp32 partials of that schedule, an fp32 merge")  # fmt: skip
        control, _ = mla_control_split(batch.q, cap.kv_buffer, batch.att, splits.cpu(), cap.scales(), cap.out_dtype)
        return BackendResult(out=out.cpu(), info=info, defines_empty_rows=False, control=control)


class AiterDecodePerQueryBackend(Backend):
    name = "aiter_decode_per_query"

    def availability(self) -> tuple[bool, str]:
        return aiter_status()

    def run(self, cap: Capture, opts: ReplayOptions) -> BackendResult:
        batch = per_query_batch(cap)
        ok, why = self.availability()
        if not ok:
            raise BackendUnavailable(why)
        try:
            out, info = run_aiter_decode(batch.q, cap.kv_buffer, batch.kv_indptr, batch.kv_indices, cap.scales(),
                                         AiterCall(out_dtype=cap.out_dtype, device=opts.device))  # fmt: skip
        except AssertionError as e:
            raise BackendUnavailable(f"aiter refused this input: {e}") from None
        info.update(_what(cap, batch), max_seqlen_q=1)
        return BackendResult(out=out, info=info)


__all__ = ["AiterDecodePerQueryBackend", "PerQueryBatch", "TritonDecodePerQueryBackend", "per_query_batch"]
