"""vLLM-layout captures written with a plain loop of our own (issue 27): a block table, vLLM's
null block 0, vLLM's uniform split schedule and its batch-wide split count, bf16 or fp8 KV.

Nothing here calls refmla's reference, control or search: ``refmla`` only writes the file. The
tensors are what vLLM's TRITON_MLA call holds (q [B, H, 576] bf16, a paged cache of ``blocks``
pages of ``block`` rows, block 0 the null block filled with NaN, a shuffled block table padded
with 0, NaN past each sequence's end in its last page), and ``out`` is a plain fp64 loop over
the block table (``attention``), rounded once to bf16. An fp8 cache is e4m3 of value / k_scale,
read back as ``fp8 * k_scale`` (vLLM's dequantization; ``v_scale`` = ``k_scale`` as forward_mqa
passes it).

Each PLANTS entry: name -> (function(t, spec, b) -> (out, lse, detail), the hypothesis that names
it, the detail keys the answer must match). The faults are the block-table mistakes vLLM has had:
the table read one entry on (the last page reads the row's padding, the null block), a request's
row pointer one row on (it reads the next request's table), the positions shifted by a page with
a partial last page, another request's pages of a different length, the null block read for a
real page.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

NULL = 0  # vLLM's null block
MIN_WORK_PER_SPLIT, OCCUPANCY = 512, 2  # vLLM triton_mla._compute_num_kv_splits


@dataclass(frozen=True)
class VllmSpec:
    block: int = 16  # vLLM's block size (16 or 64)
    fp8: bool = False  # an e4m3 cache with k_scale
    seq_lens: tuple = (1030, 283, 600, 77)  # the longest past 1024: vLLM splits it in 2
    heads: int = 4  # query heads on this rank
    kv_lora_rank: int = 512
    rope: int = 64
    sm_scale: float = 0.1147  # DeepSeek-V3's 1 / sqrt(192) x mscale^2
    k_scale: float = 0.0125  # fp8 only
    sm_count: int = 132  # H200
    seed: int = 0
    fault_request: int = 1  # the request a fault hits


def num_kv_splits(spec: VllmSpec) -> int:
    """vLLM's batch-wide split count: next power of two of max(1, max_seq_len // 512), capped at 2 x SMs."""
    ideal = max(1, max(spec.seq_lens) // MIN_WORK_PER_SPLIT)
    return min(1 << (ideal - 1).bit_length(), spec.sm_count * OCCUPANCY)


def make(spec: VllmSpec) -> dict:
    """The capture's tensors: q, kv_buffer [blocks * P, 1, D], block_table [B, M], seq_lens, num_kv_splits."""
    g = torch.Generator().manual_seed(spec.seed)
    P, D, B = spec.block, spec.kv_lora_rank + spec.rope, len(spec.seq_lens)
    pages = [-(-L // P) for L in spec.seq_lens]
    blocks = sum(pages) + 4  # the null block, three spare pages
    latent = torch.randn(blocks * P, 1, D, generator=g, dtype=torch.float64)
    if spec.fp8:
        kv = (latent / spec.k_scale).clamp(-448, 448).to(torch.float8_e4m3fn)  # amax / 448 ~ k_scale
    else:
        kv = latent.to(torch.bfloat16)
    perm = torch.randperm(blocks - 1, generator=g) + 1  # shuffled pages, never the null block
    table = torch.full((B, max(pages) + 2), NULL, dtype=torch.int32)  # padded with the null block
    used = 0
    for b, (L, n) in enumerate(zip(spec.seq_lens, pages)):
        table[b, :n] = perm[used : used + n]
        used += n
    kv = _nan_rows(kv, table, spec)
    q = (torch.randn(B, spec.heads, D, generator=g) * 0.5).to(torch.bfloat16)
    seq = torch.tensor(spec.seq_lens, dtype=torch.int32)
    splits = torch.full((B,), num_kv_splits(spec), dtype=torch.int32)
    return {"q": q, "kv_buffer": kv, "block_table": table, "seq_lens": seq, "num_kv_splits": splits}


def _nan_rows(kv: torch.Tensor, table: torch.Tensor, spec: VllmSpec) -> torch.Tensor:
    """NaN in the null block and past each sequence's end in its last page (a correct kernel reads neither)."""
    P, bits = spec.block, kv.view(torch.uint8) if kv.dtype.itemsize == 1 else None
    rows = [range(NULL * P, NULL * P + P)]
    for b, L in enumerate(spec.seq_lens):
        if L % P:
            last = int(table[b, (L - 1) // P])
            rows.append(range(last * P + L % P, last * P + P))
    for r in rows:
        idx = torch.tensor(list(r), dtype=torch.long)
        if bits is not None:
            bits[idx] = 0x7F  # e4m3fn NaN
        else:
            kv[idx] = float("nan")
    return kv


def meta(spec: VllmSpec) -> dict:
    """What vLLM's hook writes for a TRITON_MLA decode call."""
    s = spec.k_scale if spec.fp8 else 1.0
    return {"mode": "decode", "backend": "vllm_triton", "engine": "vllm", "engine_backend": "TRITON_MLA",
            "engine_version": "0.33.0", "kv_lora_rank": spec.kv_lora_rank, "qk_rope_head_dim": spec.rope,
            "sm_scale": spec.sm_scale, "logit_cap": 0.0, "page_size": spec.block, "k_scale": s, "v_scale": s,
            "null_block": NULL, "kv_cache_dtype": "fp8" if spec.fp8 else "auto", "split_schedule": "uniform",
            "max_kv_splits": num_kv_splits(spec)}  # fmt: skip


def rows_of(t: dict, spec: VllmSpec, b: int, table=None, L=None) -> torch.Tensor:
    """Request b's pool rows in position order, read through ``table`` (default the capture's)."""
    table = t["block_table"] if table is None else table
    L = spec.seq_lens[b] if L is None else L
    pos = torch.arange(L)
    return table[b].long()[pos // spec.block] * spec.block + pos % spec.block


def attention(t: dict, spec: VllmSpec, rows: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """out [B, H, Dv], lse [B, H] fp64: softmax(q . k * sm_scale) . v per request and head, k the
    dequantized cache row (fp8 * k_scale). ``rows``: request -> pool rows it reads instead."""
    q, kv, Dv = t["q"], t["kv_buffer"], spec.kv_lora_rank
    scale = spec.k_scale if spec.fp8 else 1.0
    B, H, _ = q.shape
    out = torch.zeros(B, H, Dv, dtype=torch.float64)
    lse = torch.full((B, H), -math.inf, dtype=torch.float64)
    for b in range(B):
        r = rows[b] if rows and b in rows else rows_of(t, spec, b)
        k = kv[r, 0].double() * scale  # [L, D]
        for h in range(H):
            s = (k @ q[b, h].double()) * spec.sm_scale  # [L]
            m = float(s.max())
            p = torch.exp(s - m)
            out[b, h] = (p[:, None] * k[:, :Dv]).sum(0) / p.sum()
            lse[b, h] = m + math.log(float(p.sum()))
    return out, lse


def clean(t, spec, b):
    out, lse = attention(t, spec)
    return out, lse, {}


def table_read_one_on(t, spec, b):
    """Request b reads page j from block_table[b, j + 1]: the last page reads the row's padding (the null block)."""
    table = t["block_table"].clone()
    table[b, :-1] = t["block_table"][b, 1:]
    _finite_null(t, spec)
    _finite_tail(t, spec, b)
    out, lse = attention(t, spec, {b: rows_of(t, spec, b, table)})
    return out, lse, {"entries": 1}


def row_pointer_off(t, spec, b):
    """Request b's table row pointer one row on: it reads request b + 1's table for its own length."""
    table = t["block_table"].clone()
    table[b] = t["block_table"][b + 1]
    L = spec.seq_lens[b]
    if -(-L // spec.block) > -(-spec.seq_lens[b + 1] // spec.block):
        raise ValueError("row_pointer_off needs request b + 1 to hold at least as many pages")
    out, lse = attention(t, spec, {b: rows_of(t, spec, b, table)})
    return out, lse, {"from_request": b + 1}


def pages_shift_partial(t, spec, b):
    """Request b's pages read one table entry back in the row-major table (page 0 from the previous row's
    last entry, its padding: the null block), its last page partial: a page-level shift, not a token one."""
    flat = t["block_table"].flatten().long()
    M, P, L = t["block_table"].shape[1], spec.block, spec.seq_lens[b]
    pos = torch.arange(L)
    rows = flat[b * M + pos // P - 1] * P + pos % P
    _finite_null(t, spec)
    out, lse = attention(t, spec, {b: rows})
    return out, lse, {"entries": -1}


def other_request_rows(t, spec, b):
    """Request b attends request 0's rows (a different length) instead of its own."""
    out, lse = attention(t, spec, {b: rows_of(t, spec, 0)})
    return out, lse, {"from_request": 0}


def null_block_for_page(t, spec, b):
    """Page 1 of request b read from the null block (which holds stale finite rows)."""
    _finite_null(t, spec)
    table = t["block_table"].clone()
    table[b, 1] = NULL
    out, lse = attention(t, spec, {b: rows_of(t, spec, b, table)})
    return out, lse, {"page": 1, "null_block": NULL}


def _finite_null(t, spec) -> None:
    """The null block written with finite garbage (vLLM #39444): reading it is then a wrong value, not a NaN."""
    g = torch.Generator().manual_seed(7)
    P, kv = spec.block, t["kv_buffer"]
    rows = torch.randn(P, 1, kv.shape[-1], generator=g, dtype=torch.float64) * 3.0
    rows = rows.clamp(-5, 5)
    kv[NULL * P : NULL * P + P] = (rows / spec.k_scale if spec.fp8 else rows).to(kv.dtype)


def _finite_tail(t, spec, b) -> None:
    """Request b's last page's tail (past its end) holds finite rows: what a reader past the end sees."""
    P, L, kv = spec.block, spec.seq_lens[b], t["kv_buffer"]
    last = int(t["block_table"][b, (L - 1) // P])
    g = torch.Generator().manual_seed(9)
    n = P - L % P if L % P else 0
    if n:
        rows = torch.randn(n, 1, kv.shape[-1], generator=g, dtype=torch.float64)
        kv[last * P + L % P : last * P + P] = (rows / spec.k_scale if spec.fp8 else rows).to(kv.dtype)


# name -> (planter, the hypothesis that names it, detail keys that must match)
PLANTS = {
    "table_read_one_on": (table_read_one_on, "block_table_read_off", ("entries",)),
    "row_pointer_off": (row_pointer_off, "other_table_row_read", ("from_request",)),
    "pages_shift_partial": (pages_shift_partial, "block_table_read_off", ("entries",)),
    "other_request_rows": (other_request_rows, "other_request_read", ("from_request",)),
    "null_block_for_page": (null_block_for_page, "null_block_read", ("page", "null_block")),
}


def capture(spec: VllmSpec, plant: str = "none") -> tuple[dict, dict, dict]:
    """(tensors with out and lse, meta, planted detail): ``out`` rounded once to bf16, lse to fp32."""
    t = make(spec)
    out, lse, detail = (clean if plant == "none" else PLANTS[plant][0])(t, spec, spec.fault_request)
    t["out"], t["lse"] = out.to(torch.bfloat16), lse.float()
    return t, meta(spec), detail
