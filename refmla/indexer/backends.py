"""The engines' own indexer code that replays an indexer capture here, by name:

    sglang_indexer_torch  SGLang's pure-torch decode indexer (``fp8_paged_mqa_logits_torch``, the
                          path ``SGLANG_FP8_PAGED_MQA_LOGITS_TORCH`` selects, then
                          ``topk_transform_pytorch_vectorized``), imported from the installed SGLang
    vllm_indexer_torch    vLLM's torch paged logits (``fp8_paged_mqa_logits_torch`` of
                          ``vllm.v1.attention.ops.rocm_aiter_mla_sparse``, its ROCm fallback), then
                          the top-k of each row's valid logits as vLLM's ``top_k_per_row_decode``
                          returns it (positions, -1 past the valid count; torch.topk here: the CUDA op
                          does not run on a CPU)

and the GPU kernels' adapters (refmla.indexer.adapters: ``deepgemm_paged``, ``deepgemm_ragged``,
``tilelang_indexer``, ``aiter_indexer``; unavailable, with the reason, without their package or a GPU).

Each takes the capture's inputs as SGLang's indexer hands them over (q fp8 [B, 1, H, D], the
cache viewed [P, page_size, 1, D + 4], the indexer's seq lens, the page table) and returns the
indices [B, K] in the capture's numbering (positions, or slots of production's pages). A backend
that cannot run raises :class:`Unavailable` (the entry is ``skipped`` with why).
"""

from __future__ import annotations

from typing import Callable

import torch

from refmla.indexer.adapters import ADAPTERS, Unavailable
from refmla.indexer.adapters import availability as adapter_availability
from refmla.indexer.format import IndexerCapture


def _sglang():
    from refmla.backends.cpu_compat import torchvision_cpu_shim

    torchvision_cpu_shim()
    try:
        from sglang.srt.layers.attention.dsv4 import indexer
    except Exception as e:
        raise Unavailable(f"sglang.srt.layers.attention.dsv4.indexer not importable: {type(e).__name__}: {e}") from None
    return indexer


def sglang_indexer_torch(cap: IndexerCapture) -> torch.Tensor:
    m, (B, H, D) = cap.meta, cap.q.shape
    if m.k_layout != "fp8" or cap.q.element_size() != 1 or cap.q_scale is not None:
        raise Unavailable("SGLang's torch indexer takes fp8 q (its scale in the weights) and fp8 keys")
    if m.page_size != 64 or D != 128 or m.fp8_dtype != "float8_e4m3fn":
        raise Unavailable(f"SGLang's torch indexer takes pages of 64, D 128, e4m3fn (this capture: {m.page_size}, {D}, {m.fp8_dtype})")
    ind = _sglang()
    kv = cap.k_cache[:, : m.page_size * (D + 4)].contiguous().view(-1, m.page_size, 1, D + 4)
    table = cap.page_table.int().clamp(min=0)
    n = cap.entries.int()
    logits = ind.fp8_paged_mqa_logits_torch(cap.q_values().view(torch.float8_e4m3fn).unsqueeze(1).contiguous(), kv,
                                            cap.weights.float(), n, table, None, table.shape[1] * m.page_size,
                                            clean_logits=False)  # fmt: skip
    slots = torch.empty(B, m.topk, dtype=torch.int32)
    raw = torch.empty(B, m.topk, dtype=torch.int32)
    ind.topk_transform_pytorch_vectorized(logits, n, table, slots, m.page_size, out_raw_indices=raw)
    if m.indices_kind == "positions":
        return raw
    if cap.k_cache_pages is None:
        return slots
    prod = cap.k_cache_pages.long()[slots.long().clamp(min=0) // m.page_size] * m.page_size + slots.long() % m.page_size
    return torch.where(slots >= 0, prod, -1).int()


def _slots(cap: IndexerCapture, pos: torch.Tensor) -> torch.Tensor:
    """[B, K] positions (-1 invalid) in the capture's numbering: themselves, or production slots."""
    if cap.meta.indices_kind == "positions":
        return pos.int()
    ps = cap.meta.page_size
    rows = torch.gather(cap.page_table.long(), 1, (pos.clamp(min=0) // ps).long())
    prod = cap.k_cache_pages.long()[rows] if cap.k_cache_pages is not None else rows
    return torch.where(pos >= 0, prod * ps + pos % ps, -1).int()


def vllm_indexer_torch(cap: IndexerCapture) -> torch.Tensor:
    m, (B, H, D) = cap.meta, cap.q.shape
    if m.k_layout != "fp8" or cap.q.element_size() != 1 or cap.q_scale is not None or m.fp8_dtype != "float8_e4m3fn":
        raise Unavailable("vLLM's torch indexer takes e4m3fn q (its scale in the weights) and fp8 keys")
    from refmla.backends.cpu_compat import torchvision_cpu_shim

    torchvision_cpu_shim()
    try:
        from vllm.v1.attention.ops.rocm_aiter_mla_sparse import fp8_paged_mqa_logits_torch
    except Exception as e:
        raise Unavailable(f"vllm.v1.attention.ops.rocm_aiter_mla_sparse not importable: {type(e).__name__}: {e}") from None
    kv = cap.k_cache[:, : m.page_size * (D + 4)].contiguous().view(-1, m.page_size, 1, D + 4)
    table, n = cap.page_table.int().clamp(min=0), cap.entries.int()
    logits = fp8_paged_mqa_logits_torch(cap.q_values().unsqueeze(1).contiguous(), kv, cap.weights.float(), n, table,
                                        table.shape[1] * m.page_size)  # fmt: skip
    pos = torch.full((B, m.topk), -1, dtype=torch.int64)
    for b in range(B):
        k = min(m.topk, int(n[b]))
        pos[b, :k] = torch.topk(logits[b, : int(n[b])], k).indices
    return _slots(cap, pos)


KERNELS = {"sglang_indexer_torch": ("sglang", "sglang.srt.layers.attention.dsv4.indexer.fp8_paged_mqa_logits_torch"),
           "vllm_indexer_torch": ("vllm", "vllm.v1.attention.ops.rocm_aiter_mla_sparse.fp8_paged_mqa_logits_torch"),
           "deepgemm_paged": ("deep_gemm", "deep_gemm.fp8_paged_mqa_logits"),
           "deepgemm_ragged": ("deep_gemm", "deep_gemm.fp8_mqa_logits"),
           "tilelang_indexer": ("sglang", "sglang.kernels.ops.attention.dsa.tilelang_kernel.tilelang_fp8_paged_mqa_logits"),
           "aiter_indexer": ("aiter", "aiter.ops.triton.pa_mqa_logits.deepgemm_fp8_paged_mqa_logits")}  # fmt: skip


def availability(name: str) -> tuple[bool, str]:
    """(installed, what) of an engine's indexer code, without importing the engine (that takes seconds)."""
    from importlib import metadata

    if name in ADAPTERS:
        return adapter_availability(name)
    engine = KERNELS[name][0]
    try:
        return True, f"{engine} {metadata.version(engine)} installed (runs on CPU; fp8 captures, pages of 64, D 128)"
    except metadata.PackageNotFoundError:
        return False, f"{engine} not installed"


BACKENDS: dict[str, Callable[[IndexerCapture], torch.Tensor]] = {"sglang_indexer_torch": sglang_indexer_torch,
                                                                 "vllm_indexer_torch": vllm_indexer_torch, **ADAPTERS}
FP8_ONLY = tuple(BACKENDS)  # every one takes fp8 q and keys (a bf16 capture: skipped with the reason)

__all__ = ["BACKENDS", "FP8_ONLY", "KERNELS", "Unavailable", "availability", "sglang_indexer_torch", "vllm_indexer_torch"]
