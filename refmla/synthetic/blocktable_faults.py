"""Faults of the block-table kernels (vLLM, FlashMLA, FlashInfer, CUTLASS), planted with their own loop.

Each gives the synthetic capture a ``block_table`` (its pages as SGLang's slots already lie,
padded past every sequence with the null block: a free page holding stale, finite rows) and
computes the broken kernel's output with :func:`attend`, a plain fp64 softmax loop of its own:
the reference code the replay tests is never called here (the planting must not share the
search's arithmetic).

    read_past_block_table  request b attended 2 positions past its seq_len, read through the table
                           (vLLM #51065 / #51848)                            -> seq_len_off_by
    padded_row_nan         a zero-length request's NaN row leaked into another request's row
                           (vLLM #37442, FlashInfer #2883)                    -> padded_row_leak
    null_block_read        page 1 of request b read from the null block (vLLM #39444) -> null_block_read
    pages_as_tokens        page ids used as token slots (SGLang #11985, reversed) -> pages_as_tokens
    kv_scale_inconsistent  fp8: V dequantized with k_scale (vLLM #37054)       -> kv_scale_misapplied
"""

from __future__ import annotations

import dataclasses
import math

import torch

from refmla.synthetic.faults import Planting, fault
from refmla.synthetic.spec import SynthSpec


def attend(p: Planting, rows_of: dict, k_scale: float = None, v_scale: float = None) -> torch.Tensor:
    """out [B, H, Dv] fp64: each request's q over the pool rows ``rows_of[b]`` (default: its own)."""
    t, s = p.t, p.spec
    ks = s.k_scale if k_scale is None else k_scale
    vs = s.v_scale if v_scale is None else v_scale
    B, H, _ = t["q"].shape
    out = torch.full((B, H, s.kv_lora_rank), math.nan, dtype=torch.float64)
    for b in range(B):
        lo, hi = p.bounds(b)
        rows = rows_of.get(b, t["kv_indices"][lo:hi].long())
        if len(rows) == 0:
            continue  # a zero-length request: left NaN, as the kernels leave it
        kv = t["kv_buffer"][rows, 0].double()  # [L, D]
        logits = t["q"][b].double() @ kv.T * (s.sm_scale * ks)  # [H, L]
        if s.logit_cap > 0:
            logits = s.logit_cap * torch.tanh(logits / s.logit_cap)
        w = torch.softmax(logits, dim=-1)  # [H, L]
        out[b] = w @ kv[:, : s.kv_lora_rank] * vs  # [H, Dv]
    return out


def with_table(p: Planting) -> tuple[torch.Tensor, int]:
    """Give the capture a block table of its pages, padded with a null block; (table, null page)."""
    t, P = p.t, p.spec.page_size
    N = t["kv_buffer"].shape[0] // P
    lens = t["seq_lens"].long().tolist()
    need = [-(-L // P) for L in lens]
    used = {int(r) // P for r in t["kv_indices"].tolist()}
    null = next(pg for pg in range(N) if pg not in used)  # a free page
    g = torch.Generator().manual_seed(p.spec.seed + 7)
    stale = torch.randn(P, t["kv_buffer"].shape[-1], generator=g)
    if t["kv_buffer"].dtype.itemsize == 1:
        stale = stale / p.spec.k_scale
    t["kv_buffer"][null * P : (null + 1) * P, 0] = stale.to(t["kv_buffer"].dtype)  # stale rows, finite
    table = torch.full((len(lens), max(need + [0]) + 2), null, dtype=torch.int32)
    for b, L in enumerate(lens):
        lo, _ = p.bounds(b)
        for j in range(need[b]):
            table[b, j] = int(t["kv_indices"][lo + j * P]) // P
    t["block_table"] = table
    return table, null


def _paged(spec: SynthSpec) -> SynthSpec:
    return spec if spec.page_size > 1 else dataclasses.replace(spec, page_size=16)


@fault("read_past_block_table", "block table: the kernel attended 2 positions past seq_len, read through the table",
       expect="seq_len_off_by", spec=_paged)  # fmt: skip
def _read_past(p: Planting):
    table, _ = with_table(p)
    b, P = p.request, p.spec.page_size
    lo, hi = p.bounds(b)
    pos = torch.arange(hi - lo, hi - lo + 2)
    extra = table[b].long()[pos // P] * P + pos % P  # [2] the rows past the sequence
    g = torch.Generator().manual_seed(p.spec.seed + 11)
    t = p.t
    rows = torch.randn(2, t["kv_buffer"].shape[-1], generator=g).double()  # stale rows past the sequence
    mean_q = t["q"][b].double().mean(0)  # [D]: both stale rows salient, so the heads visibly attend each
    scale = p.spec.sm_scale * p.spec.k_scale * float((t["q"][b].double() @ mean_q).mean())
    if scale > 0:
        rows = mean_q[None, :] * (8.0 / scale) + rows  # [2, D] distinct values, each well attended
    if t["kv_buffer"].dtype.itemsize == 1:
        rows = rows / p.spec.k_scale
    t["kv_buffer"][extra, 0] = rows.to(t["kv_buffer"].dtype)
    read = torch.cat([t["kv_indices"][lo:hi].long(), extra])
    return attend(p, {b: read}), {"request": b, "delta": 2}


def _with_padded(spec: SynthSpec) -> SynthSpec:
    """A zero-length request in the batch, and the fault request whole pages long (so nothing of its
    own, not even a read past its end into a NaN page tail, makes its row NaN)."""
    spec = _paged(spec)
    lens, P, b = list(spec.seq_lens), spec.page_size, spec.fault_request
    if 0 not in lens:
        lens[-1 if b != len(lens) - 1 else 0] = 0
    lens[b] = -(-max(lens[b], 1) // P) * P
    return dataclasses.replace(spec, seq_lens=tuple(lens), num_kv_splits=tuple([1] * len(lens)))


@fault("padded_row_nan", "a zero-length (padded) request's NaN leaked into another request's row",
       expect="padded_row_leak", spec=_with_padded)  # fmt: skip
def _padded_row_nan(p: Planting):
    with_table(p)
    out = attend(p, {})
    padded = int(torch.nonzero(p.t["seq_lens"] == 0).flatten()[0])
    out[p.request] = math.nan
    return out, {"padded_request": padded, "request": p.request}


@fault("null_block_read", "block table: page 1 of the fault request read from the null block", spec=_paged)
def _null_block_read(p: Planting):
    _, null = with_table(p)
    b, P = p.request, p.spec.page_size
    lo, hi = p.bounds(b)
    rows = p.t["kv_indices"][lo:hi].long().clone()
    if len(rows) <= P:
        raise ValueError(f"request {b} has one page: no page 1 to read from the null block")
    pos = torch.arange(P, min(2 * P, len(rows)))
    rows[pos] = null * P + pos % P
    return attend(p, {b: rows}), {"request": b, "page": 1, "null_block": null}


@fault("pages_as_tokens", "block table: the kernel took the page ids for token slots", spec=_paged)
def _pages_as_tokens(p: Planting):
    table, _ = with_table(p)
    b, P, t = p.request, p.spec.page_size, p.t
    lo, hi = p.bounds(b)
    pos = torch.arange(hi - lo)
    rows = table[b].long()[pos // P]  # [L] page ids, read as rows
    g = torch.Generator().manual_seed(p.spec.seed + 13)
    bad = torch.isnan(t["kv_buffer"][rows, 0].float()).any(-1)  # rows never written: stale, finite
    if bool(bad.any()):
        fill = torch.randn(int(bad.sum()), t["kv_buffer"].shape[-1], generator=g)
        t["kv_buffer"][rows[bad], 0] = fill.to(t["kv_buffer"].dtype)
    return attend(p, {b: rows}), {"request": b, "read": "page ids as token slots"}


def _fp8_uneven(spec: SynthSpec) -> SynthSpec:
    return dataclasses.replace(_paged(spec), kv_dtype=torch.float8_e4m3fn, k_scale=0.8125, v_scale=1.375)


@fault("kv_scale_inconsistent", "fp8: V dequantized with k_scale (one scale for K and V)",
       expect="kv_scale_misapplied", spec=_fp8_uneven)  # fmt: skip
def _kv_scale_inconsistent(p: Planting):
    with_table(p)
    return attend(p, {}, v_scale=p.spec.k_scale), {"scale": "v_scale", "applied": "the other scale in its place"}


__all__ = ["attend", "with_table"]
