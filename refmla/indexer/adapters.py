"""The GPU indexer kernels, called as SGLang's indexer calls them (their real signatures), their
logits then topped by :func:`topk_rows` (torch.topk over each row's valid entries: the logits
kernels are what is judged here; the engines' top-k kernels are GPU ops of their own):

    deepgemm_paged    ``deep_gemm.fp8_paged_mqa_logits(q [B, 1, H, D] fp8, kv_cache [P, page, 1, D + 4]
                      uint8, weights [B, H] fp32, context_lens [B, 1] int32, block_tables [B, M] int32,
                      schedule_meta, max_context_len, clean_logits=False)`` with ``schedule_meta =
                      deep_gemm.get_paged_mqa_logits_metadata(context_lens, page, deep_gemm.get_num_sms())``
                      (SGLang's decode path, deepgemm_paged_mqa_logits_split)
    deepgemm_ragged   ``deep_gemm.fp8_mqa_logits(q [M, H, D] fp8, (k [N, D] fp8, k_scales [N] fp32),
                      weights [M, H] fp32, cu_seqlen_ks [M], cu_seqlen_ke [M], clean_logits=False)``
                      over each request's keys gathered in position order (SGLang's extend path)
    tilelang_indexer  SGLang's ``tilelang_fp8_paged_mqa_logits`` (sglang.kernels.ops.attention.dsa.
                      tilelang_kernel; DeepGEMM's arguments, its metadata unused; pages of 64, D 128)
    aiter_indexer     ``aiter.ops.triton.pa_mqa_logits.deepgemm_fp8_paged_mqa_logits(q [B, 1, H, D],
                      kv_cache, weights, out_logits [B, max_len] fp32, seq_lens, block_tables,
                      max_len, Preshuffle=False, KVBlockSize=page)`` writing into ``out_logits``
                      (SGLang's aiter_paged_mqa_logits)

Each needs its package and a GPU (``DEVICE``); without them it raises :class:`Unavailable` with
the reason, and :func:`availability` says so without importing anything heavy (``refmla doctor``).
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Callable

import torch

from refmla.indexer.format import IndexerCapture

DEVICE = "cuda"  # where the kernels run (the tests' stand-ins run on "cpu")
PACKAGES = {"deepgemm_paged": ("deep_gemm",), "deepgemm_ragged": ("deep_gemm",),
            "tilelang_indexer": ("tilelang", "sglang"), "aiter_indexer": ("aiter",)}  # fmt: skip


class Unavailable(RuntimeError):
    """The kernel cannot run here, or not on this capture; the message says why."""


def _module(name: str):
    try:
        return importlib.import_module(name)
    except Exception as e:
        raise Unavailable(f"{name} not importable: {type(e).__name__}: {e}") from None


def _device_ok() -> None:
    if DEVICE == "cuda" and not torch.cuda.is_available():
        raise Unavailable("needs a CUDA / ROCm GPU (torch.cuda.is_available() is False)")


def _fp8_inputs(cap: IndexerCapture, name: str) -> tuple:
    """(q [B, 1, H, D] fp8, kv [P, page, 1, D + 4] uint8, weights [B, H] fp32, lens [B] int32, table [B, M]
    int32) on DEVICE, as SGLang hands them over; Unavailable for a capture the kernel does not take."""
    m, (B, H, D) = cap.meta, cap.q.shape
    if m.k_layout != "fp8" or cap.q.element_size() != 1 or cap.q_scale is not None:
        raise Unavailable(f"{name} takes fp8 q (its scale in the weights) and fp8 keys")
    _device_ok()
    q = cap.q_values().unsqueeze(1).contiguous().to(DEVICE)
    kv = cap.k_cache[:, : m.page_size * (D + 4)].contiguous().view(-1, m.page_size, 1, D + 4).to(DEVICE)
    table = cap.page_table.int().clamp(min=0).contiguous().to(DEVICE)
    return q, kv, cap.weights.float().contiguous().to(DEVICE), cap.entries.int().to(DEVICE), table


def topk_rows(cap: IndexerCapture, logits: torch.Tensor) -> torch.Tensor:
    """[B, K] the top min(K, L) of each row's first L logits (L the request's entries), -1 past them,
    in the capture's numbering (positions, or slots of production's pages)."""
    B, K, ps = cap.q.shape[0], cap.meta.topk, cap.meta.page_size
    logits = logits.float().cpu()
    pos = torch.full((B, K), -1, dtype=torch.int64)
    for b in range(B):
        n = int(cap.entries[b])
        k = min(K, n)
        pos[b, :k] = torch.topk(logits[b, :n], k).indices
    if cap.meta.indices_kind == "positions":
        return pos
    rows = torch.gather(cap.page_table.long(), 1, (pos.clamp(min=0) // ps))
    prod = cap.k_cache_pages.long()[rows] if cap.k_cache_pages is not None else rows
    return torch.where(pos >= 0, prod * ps + pos % ps, -1)


def deepgemm_paged(cap: IndexerCapture) -> torch.Tensor:
    dg = _module("deep_gemm")  # the package first: its absence is the reason a replay gives, as doctor does
    q, kv, w, lens, table = _fp8_inputs(cap, "DeepGEMM's fp8_paged_mqa_logits")
    lens2 = lens.unsqueeze(1).contiguous()  # [B, next_n = 1]
    meta = dg.get_paged_mqa_logits_metadata(lens2, cap.meta.page_size, dg.get_num_sms())
    logits = dg.fp8_paged_mqa_logits(q, kv, w, lens2, table, meta, table.shape[1] * cap.meta.page_size, clean_logits=False)
    return topk_rows(cap, logits)


def deepgemm_ragged(cap: IndexerCapture) -> torch.Tensor:
    dg = _module("deep_gemm")
    q, kv, w, lens, table = _fp8_inputs(cap, "DeepGEMM's fp8_mqa_logits")
    ps, D = cap.meta.page_size, cap.q.shape[2]
    keys, scales, starts = [], [], []
    at = 0
    for b in range(cap.q.shape[0]):  # request b's entries, in position order, one after another
        n = int(lens[b])
        pages = kv[table[b, : (n + ps - 1) // ps].long()]  # [p, ps, 1, D + 4]
        flat = pages.reshape(-1, ps * (D + 4))
        keys.append(flat[:, : ps * D].reshape(-1, D)[:n])
        scales.append(flat[:, ps * D :].contiguous().view(torch.float32).reshape(-1)[:n])
        starts.append(at)
        at += n
    k8 = torch.cat(keys).contiguous().view(q.dtype)  # [N, D] fp8
    ks = torch.tensor(starts, dtype=torch.int32, device=q.device)
    logits = dg.fp8_mqa_logits(q[:, 0].contiguous(), (k8, torch.cat(scales).contiguous()), w, ks, ks + lens,
                               clean_logits=False)  # [B, N]  # fmt: skip
    rows = torch.stack([torch.roll(logits[b].float().cpu(), -starts[b]) for b in range(len(starts))]) if starts else logits
    return topk_rows(cap, rows)


def tilelang_indexer(cap: IndexerCapture) -> torch.Tensor:
    if cap.meta.page_size != 64 or cap.q.shape[2] != 128:
        raise Unavailable(f"SGLang's tilelang indexer takes pages of 64 and D 128 (this capture: {cap.meta.page_size}, "
                          f"{cap.q.shape[2]})")  # fmt: skip
    _module("tilelang")
    tk = _module("sglang.kernels.ops.attention.dsa.tilelang_kernel")
    q, kv, w, lens, table = _fp8_inputs(cap, "SGLang's tilelang indexer")
    logits = tk.tilelang_fp8_paged_mqa_logits(q, kv, w, lens, table, None, table.shape[1] * cap.meta.page_size,
                                              clean_logits=False)  # fmt: skip
    return topk_rows(cap, logits)


def aiter_indexer(cap: IndexerCapture) -> torch.Tensor:
    pa = _module("aiter.ops.triton.pa_mqa_logits")
    q, kv, w, lens, table = _fp8_inputs(cap, "aiter's deepgemm_fp8_paged_mqa_logits")
    width = table.shape[1] * cap.meta.page_size
    logits = torch.empty(q.shape[0], width, dtype=torch.float32, device=q.device)
    pa.deepgemm_fp8_paged_mqa_logits(q, kv, w, logits, lens, table, width, Preshuffle=False, KVBlockSize=cap.meta.page_size)
    return topk_rows(cap, logits)


ADAPTERS: dict[str, Callable[[IndexerCapture], torch.Tensor]] = {
    "deepgemm_paged": deepgemm_paged, "deepgemm_ragged": deepgemm_ragged,
    "tilelang_indexer": tilelang_indexer, "aiter_indexer": aiter_indexer,
}  # fmt: skip


def availability(name: str) -> tuple[bool, str]:
    """(runs here, its package's version or why not), by the package's presence and the GPU alone."""
    from importlib import metadata

    missing = [p for p in PACKAGES[name] if importlib.util.find_spec(p) is None]
    if missing:
        return False, f"{' and '.join(missing)} not installed"
    if DEVICE == "cuda" and not torch.cuda.is_available():
        return False, f"{PACKAGES[name][0]} installed, but no CUDA / ROCm GPU here"
    try:
        version = metadata.version(PACKAGES[name][0].replace("_", "-"))
    except metadata.PackageNotFoundError:
        version = "(version unknown)"
    return True, f"{PACKAGES[name][0]} {version} on {DEVICE}"


__all__ = ["ADAPTERS", "DEVICE", "PACKAGES", "Unavailable", "aiter_indexer", "availability", "deepgemm_paged",
           "deepgemm_ragged", "tilelang_indexer", "topk_rows"]
