"""The persistent kernel's work buffers, rebuilt through aiter's own functions as SGLang builds them,
and compared with production's when the capture carries them.

SGLang 0.5.23 (``AiterAttnBackend.make_mla_decode_meta_data_buffer`` / ``make_mla_meta_data``):

    sizes = get_mla_metadata_info_v1(batch_size, max_seqlen_qo=1, num_head_qo=Hk,
                                     q_dtype=kv_dtype, kv_dtype=kv_dtype, is_sparse=False,
                                     fast_mode, num_kv_splits=max_split_per_batch, intra_batch_mode)
    six buffers torch.empty(size, dtype) in this order:
        work_meta_data [2] uint64 (two device pointers), work_indptr [cu + 1],
        work_info_set [works, 8], reduce_indptr [tiles + 1], reduce_final_map [tiles, 2],
        reduce_partial_map [partials]                                   (all int32 but the first)
    get_mla_metadata_v1(qo_indptr, kv_indptr, kv_last_page_lens, Hk // 1, 1, False, <buffers>,
                        kv_granularity=max(page_size, 16), max_seqlen_qo=1, uni_seqlen_qo=1,
                        fast_mode, max_split_per_batch, intra_batch_mode, is_cp_round_robin=False,
                        dtype_q=kv_dtype, dtype_kv=kv_dtype)

(SGLang passes the KV dtype as q's dtype too.) Both are called here by keyword from their
signatures (:func:`refmla.backends.calling.kwargs_for`). Only the part a kernel reads is compared
(the buffers come from torch.empty; their tails are whatever memory held): ``work_indptr`` whole,
``work_info_set[:work_indptr[-1]]``, ``reduce_indptr`` whole, ``reduce_final_map[:len(reduce_indptr) - 1]``,
``reduce_partial_map[:reduce_indptr[-1]]``. ``work_meta_data`` holds pointers and is never compared.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from refmla.backends.aiter.paths import AiterPath, sglang_modes
from refmla.backends.base import BackendUnavailable, BackendFinding
from refmla.backends.calling import KernelSignatureError, first_module_with, kwargs_for

BUFFERS = ("work_meta_data", "work_indptr", "work_info_set", "reduce_indptr", "reduce_final_map", "reduce_partial_map")
CAPTURED = BUFFERS[1:]  # capture tensor "aiter_<name>"; work_meta_data (pointers) is never captured
_WHERE = ("aiter", "aiter.ops.attention")
# names some aiter releases use for a parameter -> the key refmla fills
_ALIASES = {"work_metadata": "work_metadata_ptrs", "work_meta_data": "work_metadata_ptrs", "work_info": "work_info_set"}


def metadata_functions() -> tuple[Callable, Callable, str]:
    """(get_mla_metadata_info_v1, get_mla_metadata_v1, module) of the installed aiter."""
    mod, name, tried = first_module_with(_WHERE, ("get_mla_metadata_info_v1", "get_mla_metadata_v1"))
    if mod is not None:
        return mod.get_mla_metadata_info_v1, mod.get_mla_metadata_v1, name
    raise BackendUnavailable("production ran aiter's persistent kernel, not replayed here: this aiter has no "
                             "persistent metadata functions (" + "; ".join(tried) + ")")  # fmt: skip


def plan_modes(path: AiterPath, kernel_heads: int) -> tuple[bool, bool, int]:
    """(fast_mode, intra_batch_mode, max_split_per_batch): recorded, else SGLang 0.5.23's choice."""
    fast, intra, splits = sglang_modes(kernel_heads)
    fast = fast if path.fast_mode is None else bool(path.fast_mode)
    intra = intra if path.intra_batch_mode is None else bool(path.intra_batch_mode)
    splits = splits if path.max_split_per_batch is None else int(path.max_split_per_batch)
    return fast, intra, splits


def _call(fn: Callable, values: dict[str, Any], what: str) -> tuple[Any, dict]:
    try:
        kwargs = kwargs_for(fn, values, aliases=_ALIASES)
    except KernelSignatureError as e:
        raise BackendUnavailable(f"production ran aiter's persistent kernel, not replayed here: {what}: {e}") from None
    return fn(**kwargs), kwargs


def _scalars(kwargs: dict) -> dict:
    """The JSON-able arguments of a call (tensors named by shape, dtypes by name)."""
    out = {}
    for k, v in kwargs.items():
        if isinstance(v, torch.Tensor):
            out[k] = f"tensor{list(v.shape)} {str(v.dtype).replace('torch.', '')}"
        elif isinstance(v, torch.dtype):
            out[k] = str(v).replace("torch.", "")
        else:
            out[k] = v
    return out


def build_metadata(path: AiterPath, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, kv_last_page_lens: torch.Tensor,
                   *, kernel_heads: int, kv_dtype: torch.dtype, page_size: int,
                   device: torch.device) -> tuple[dict[str, torch.Tensor], list[dict]]:  # fmt: skip
    """The six persistent buffers for this batch, and the two calls as made (name + arguments)."""
    info_fn, meta_fn, where = metadata_functions()
    fast, intra, splits = plan_modes(path, kernel_heads)
    B = kv_indptr.shape[0] - 1
    sizes, info_kwargs = _call(info_fn, dict(
        batch_size=B, max_seqlen_qo=1, num_head_qo=kernel_heads, q_dtype=kv_dtype, kv_dtype=kv_dtype,
        is_sparse=False, fast_mode=fast, num_kv_splits=splits, intra_batch_mode=intra,
    ), "get_mla_metadata_info_v1")  # fmt: skip
    buffers = {name: torch.empty(size, dtype=dtype, device=device) for name, (size, dtype) in zip(BUFFERS, sizes)}
    granularity = int(path.kv_granularity) if path.kv_granularity else max(int(page_size), 16)
    _, meta_kwargs = _call(meta_fn, dict(
        seqlens_qo_indptr=qo_indptr, seqlens_kv_indptr=kv_indptr, kv_last_page_lens=kv_last_page_lens,
        num_heads_per_head_k=kernel_heads, num_heads_k=1, is_causal=False,
        work_metadata_ptrs=buffers["work_meta_data"], work_info_set=buffers["work_info_set"],
        work_indptr=buffers["work_indptr"], reduce_indptr=buffers["reduce_indptr"],
        reduce_final_map=buffers["reduce_final_map"], reduce_partial_map=buffers["reduce_partial_map"],
        kv_granularity=granularity, max_seqlen_qo=1, uni_seqlen_qo=1, fast_mode=fast,
        max_split_per_batch=splits, intra_batch_mode=intra, is_cp_round_robin=False,
        dtype_q=kv_dtype, dtype_kv=kv_dtype,
    ), "get_mla_metadata_v1")  # fmt: skip
    calls = [{"fn": f"{where}.get_mla_metadata_info_v1", "args": _scalars(info_kwargs)},
             {"fn": f"{where}.get_mla_metadata_v1", "args": _scalars(meta_kwargs)}]  # fmt: skip
    return buffers, calls


def used(buffers: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The part of each captured / rebuilt buffer a kernel reads (module docstring), on the host."""
    b = {k: v.detach().to("cpu", torch.int64) for k, v in buffers.items() if v is not None and k in CAPTURED}
    out = {}
    if "work_indptr" in b:
        out["work_indptr"] = b["work_indptr"].reshape(-1)
        if "work_info_set" in b and b["work_indptr"].numel():
            n = max(0, min(int(out["work_indptr"][-1]), b["work_info_set"].shape[0]))
            out["work_info_set"] = b["work_info_set"][:n]
    if "reduce_indptr" in b:
        ri = out["reduce_indptr"] = b["reduce_indptr"].reshape(-1)
        tiles = max(ri.numel() - 1, 0)
        if "reduce_final_map" in b:
            out["reduce_final_map"] = b["reduce_final_map"][:tiles]
        if "reduce_partial_map" in b and ri.numel():
            n = max(0, min(int(ri[-1]), b["reduce_partial_map"].shape[0]))
            out["reduce_partial_map"] = b["reduce_partial_map"].reshape(-1)[:n]
    return out


def compare_buffers(captured: dict[str, Optional[torch.Tensor]], rebuilt: dict[str, torch.Tensor]) -> list[BackendFinding]:
    """One BackendFinding per captured buffer whose used part differs from the rebuilt one."""
    prod, mine = used(captured), used(rebuilt)
    findings = []
    for name in CAPTURED:
        if name not in prod or name not in mine:
            continue
        a, b = prod[name], mine[name]
        if a.shape == b.shape and torch.equal(a, b):
            continue
        detail: dict[str, Any] = {"buffer": name, "production_shape": list(a.shape), "rebuilt_shape": list(b.shape)}
        if a.shape == b.shape:
            diff = (a != b).reshape(a.shape[0], -1).any(dim=1)
            first = int(torch.nonzero(diff)[0])
            detail.update(first_row=first, rows_differing=int(diff.sum()),
                          production=a[first].tolist(), rebuilt=b[first].tolist())  # fmt: skip
        findings.append(BackendFinding(
            kind="aiter_metadata_mismatch",
            message=f"aiter's persistent metadata rebuilt here differs from production's in {name} "
                    "(the kernel read a split plan other than the one these indices give)",
            detail=detail,
        ))  # fmt: skip
    return findings


__all__ = ["BUFFERS", "CAPTURED", "build_metadata", "compare_buffers", "metadata_functions", "plan_modes", "used"]
