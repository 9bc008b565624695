"""SGLang's split-KV schedule for MLA decode, written once for the reference, backends, hypotheses and hook.

The Triton decode kernel splits request b's L_b positions into n_b splits of

    per_b = ceil(ceil(L_b / n_b) / MIN_BLOCK_KV) * MIN_BLOCK_KV      tokens each,

split s covering [s * per_b, min((s + 1) * per_b, L_b)); the trailing ones may be empty. How many
splits production asks for (``num_kv_splits``) comes from :func:`default_num_kv_splits`, bounded
by :func:`mla_max_kv_splits`.

vLLM's TRITON_MLA kernel (adapted from SGLang's) splits uniformly: per_b = ceil(L_b / n), the same
formula with a granularity of 1 (:data:`SPLIT_BLOCKS`), and one batch-wide n
(:func:`vllm_num_kv_splits`).
"""

from __future__ import annotations

from typing import Optional

import torch

from refmla.util import cdiv

MIN_BLOCK_KV = 32  # SGLang's Triton split granularity (_MIN_BLOCK_KV)
MI355X_CU_COUNT = 256
H200_SM_COUNT = 132
# a capture's meta ``split_schedule`` -> the split granularity of its kernel: SGLang rounds a
# split's length up to 32 tokens; vLLM's TRITON_MLA splits uniformly, ceil(L / n) (granularity 1)
SPLIT_BLOCKS = {"sglang": MIN_BLOCK_KV, "uniform": 1}
# SGLang's grouped Triton decode, stage 1: positions per online-softmax step (BLOCK_N in
# _decode_grouped_att_m_fwd): 32, 16 on HIP for a head of 576 or more, the gfx950 MLA tuning's own
SGLANG_BLOCK_N = 32


def sglang_block_n(is_hip: bool, head_dim: int, tuned_block: Optional[int] = None) -> int:
    """The stage-1 BLOCK_N SGLang's grouped decode kernel launches with (``tuned_block``: gfx950's)."""
    if tuned_block:
        return int(tuned_block)
    return 16 if is_hip and head_dim >= 576 else SGLANG_BLOCK_N
# vLLM's TRITON_MLA (v1/attention/backends/mla/triton_mla.py, 0.33.0): one batch-wide split count
VLLM_MIN_WORK_PER_SPLIT = 512
VLLM_SPLIT_OCCUPANCY = 2


# --------------------------------------------------------------------------------------------
# One request
# --------------------------------------------------------------------------------------------


def split_len(seq_len: int, num_splits: int, min_block: int = MIN_BLOCK_KV) -> int:
    """Tokens per split: ceil(ceil(L / n) / 32) * 32, as the Triton stage-1 kernel computes it."""
    n = max(int(num_splits), 1)
    return cdiv(cdiv(seq_len, n), min_block) * min_block


def split_bounds(seq_len: int, num_splits: int, min_block: int = MIN_BLOCK_KV) -> list[tuple[int, int]]:
    """[start, end) of each split that holds a token, in order (entry s is split s).

    The ``num_splits - len(result)`` trailing splits are empty and left out, so the list (and the
    work of every caller) is bounded by ``seq_len / min_block`` whatever ``num_splits`` says."""
    per = split_len(seq_len, num_splits, min_block)
    return [(s * per, min((s + 1) * per, seq_len)) for s in range(nonempty_splits(seq_len, num_splits, min_block))]


def nonempty_splits(seq_len: int, num_splits: int, min_block: int = MIN_BLOCK_KV) -> int:
    """How many of the splits hold a token: ceil(L / per). The rest are empty and never written."""
    return cdiv(seq_len, split_len(seq_len, num_splits, min_block)) if seq_len > 0 else 0


# --------------------------------------------------------------------------------------------
# A batch
# --------------------------------------------------------------------------------------------


def nonempty_splits_batch(
    seq_lens: torch.Tensor, num_kv_splits: torch.Tensor, min_block: int = MIN_BLOCK_KV
) -> torch.Tensor:
    """[B] :func:`nonempty_splits` of every request at once."""
    L = seq_lens.long().cpu()  # [B]
    n = num_kv_splits.long().cpu().clamp(min=1)  # [B]
    per = cdiv(cdiv(L, n), min_block) * min_block  # [B] tokens per split
    return torch.where(L > 0, cdiv(L, per.clamp(min=1)), torch.zeros_like(L))  # [B]


def mla_max_kv_splits(cu_count: int = MI355X_CU_COUNT, max_context_len: int = 131072, base: int = 16) -> int:
    """SGLang's production ``max_kv_splits`` for an MLA model.

    From ``sglang/srt/layers/attention/triton_backend.py`` (``_mla_decode_kv_splits_cap``): the
    server's ``--triton-attention-num-kv-splits`` (8, or 16 on ROCm) raised to the smaller of the
    next power of two of the CU count and of ceil(context / 32). 256 on MI355X at long context.
    """
    if cu_count <= 0:
        return base

    def npow2(x: int) -> int:
        return 1 << max(int(x) - 1, 0).bit_length()

    return max(base, min(npow2(cu_count), npow2(cdiv(max_context_len, MIN_BLOCK_KV))))


def vllm_num_kv_splits(max_seq_len: int, sm_count: int = H200_SM_COUNT) -> int:
    """vLLM TRITON_MLA's batch-wide split count (``_compute_num_kv_splits``, 0.33.0): the next
    power of two of max(1, max_seq_len // 512), capped at 2 x the SM (CU) count."""
    ideal = max(1, int(max_seq_len) // VLLM_MIN_WORK_PER_SPLIT)
    return min(1 << (ideal - 1).bit_length(), max(1, int(sm_count)) * VLLM_SPLIT_OCCUPANCY)


def default_num_kv_splits(
    seq_lens: torch.Tensor,
    *,
    max_kv_splits: int,
    num_heads: int,
    num_kv_heads: int = 1,
    cu_count: int = MI355X_CU_COUNT,
    num_group: int = 1,
    static: bool = False,
    split_tile_size: Optional[int] = None,
) -> torch.Tensor:
    """num_kv_splits [B * num_group] int32 as SGLang's Triton backend computes it for a device.

    Written after ``TritonAttnBackend.get_num_kv_splits`` in
    ``sglang/srt/layers/attention/triton_backend.py`` and its kernel ``get_num_kv_splits_triton``
    in ``sglang/kernels/ops/attention/metadata.py`` (0.5.23), in fp32 where the kernel is:

    * static splits (``SGLANG_TRITON_DECODE_ATTN_STATIC_KV_SPLITS``) or no CU count: all
      ``max_kv_splits``; deterministic inference (``split_tile_size``): ceil(L / tile);
    * otherwise two chunk sizes, the larger split count of the two wins per request:
      - balance: a batch whose shortest request is under 80% of its longest gets
        n1 = min(ceil(Lmax / Lmin), max_kv_splits) splits of the longest, chunk1 = ceil(Lmax / n1);
      - occupancy: the CU count times max(log2(Lmax / 64), 1) (fp32, truncated) spread over the
        stage-1 grid (requests x groups x head tiles of min(16, H / Hkv) heads), capped at
        max_kv_splits: n2, chunk2 = ceil(Lmax / n2);
      n_b = max(ceil(L_b / chunk1), ceil(L_b / chunk2)).

    A zero-length request (never seen in decode) would divide by zero in SGLang; it gets 1 here.
    On a GPU ``tl.log2`` may be an approximation, so a product landing within an ulp of an integer
    could truncate differently; the interpreter (numpy) agrees with this function exactly.
    """
    L = seq_lens.long().cpu()  # [B]
    B = L.shape[0]
    if B == 0:
        return torch.zeros(0, dtype=torch.int32)
    if split_tile_size is not None:
        n = cdiv(L, int(split_tile_size)).clamp(min=1)
        return n.repeat_interleave(num_group).to(torch.int32)
    if static or cu_count <= 0:
        return torch.full((B * num_group,), int(max_kv_splits), dtype=torch.int32)

    l_max = int(L.max())
    l_min = max(int(L.min()), 1)
    if l_max * 8 < l_min * 10:  # within 25%: treat the batch as even
        l_min = l_max
    l_max = max(l_max, 1)
    n1 = min(cdiv(l_max, l_min), max_kv_splits)
    chunk1 = cdiv(l_max, n1)

    ext_seq_len = torch.tensor(l_max, dtype=torch.float32) / 64.0  # fp32, as the kernel
    ext_cores = int((cu_count * torch.clamp(torch.log2(ext_seq_len), min=1.0)).to(torch.int32))
    kv_group = num_heads // num_kv_heads
    if kv_group == 1:
        token_grid = B * num_group * num_heads
    else:
        token_grid = B * num_group * cdiv(num_heads, min(16, kv_group))
    n2 = min(cdiv(ext_cores, token_grid), max_kv_splits)
    chunk2 = cdiv(l_max, max(n2, 1))

    n = torch.maximum(cdiv(L, chunk1), cdiv(L, chunk2)).clamp(min=1)  # [B]
    return n.repeat_interleave(num_group).to(torch.int32)
