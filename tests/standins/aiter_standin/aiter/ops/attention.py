"""STAND-IN for aiter's persistent MLA metadata (``aiter.ops.attention``; tests only). Not a kernel.

    get_mla_metadata_info_v1   the six buffers' (size, dtype), with the signature of aiter's (sizes by
                               the same formulas, on an MI355X: 256 CUs, one 128-row q tile per
                               request for 16..128 heads)
    get_mla_metadata_v1        fills the buffers with a split plan: request b's KV cut into chunks of
                               kv_granularity tokens, at most max_split_per_batch of them; one work
                               item per chunk, reduce groups for requests split more than once
    check_persistent           what mla_decode_fwd checks in persistent mode: all six buffers, filled
                               by get_mla_metadata_v1 for this batch, these heads, this intra_batch_mode

Every call is recorded in METADATA_CALLS (name + arguments). A violation raises
:class:`ContractViolation` (the class aiter.mla raises too).
"""

from __future__ import annotations

import math

import torch

CU_NUM = 256
METADATA_CALLS: list[dict] = []
_FILLED: dict[int, dict] = {}  # id(work_info_set) -> the scalar arguments and the plan written


class ContractViolation(Exception):
    """An argument the real aiter would misread (aiter.mla re-exports this class)."""


def _need(ok: bool, what: str) -> None:
    if not ok:
        raise ContractViolation(what)


def _tiles(max_seqlen_qo: int, heads: int) -> int:
    return math.ceil(max_seqlen_qo * heads / 128)


def get_mla_metadata_info_v1(batch_size, max_seqlen_qo, num_head_qo, q_dtype, kv_dtype, is_sparse,
                             fast_mode=True, num_kv_splits=32, intra_batch_mode=False, max_split_per_batch=-1):  # fmt: skip
    METADATA_CALLS.append({"fn": "get_mla_metadata_info_v1", "batch_size": batch_size, "max_seqlen_qo": max_seqlen_qo,
                           "num_head_qo": num_head_qo, "q_dtype": q_dtype, "kv_dtype": kv_dtype, "is_sparse": is_sparse,
                           "fast_mode": fast_mode, "num_kv_splits": num_kv_splits,
                           "intra_batch_mode": intra_batch_mode})  # fmt: skip
    _need(num_head_qo % 16 == 0 and 16 <= num_head_qo <= 128, f"num_head_qo {num_head_qo}: pad to 16..128 first")
    _need(isinstance(q_dtype, torch.dtype) and isinstance(kv_dtype, torch.dtype), "q_dtype / kv_dtype must be dtypes")
    tiles = _tiles(max_seqlen_qo, num_head_qo)
    tile_cnt, max_splits = batch_size * tiles, CU_NUM
    if fast_mode:
        max_work = (batch_size + max_splits - 1) * tiles
        max_split_tiles = min(batch_size + max_splits - 1, (max_splits - 1) * 2) * tiles
    else:
        max_work = max_split_tiles = tile_cnt * max_splits
    if intra_batch_mode:
        max_work = max_split_tiles = tile_cnt * num_kv_splits
    return ((2, torch.uint64), (max_splits + 1, torch.int32), ((max_work, 8), torch.int32),
            (tile_cnt + 1, torch.int32), ((tile_cnt, 2), torch.int32), (max_split_tiles, torch.int32))  # fmt: skip


def plan(qo_indptr, kv_indptr, kv_last_page_lens, heads, page_size, kv_granularity, max_split_per_batch):
    """(works [n, 8], work_indptr [CU + 1], reduce_indptr [tiles + 1], final [tiles, 2], partial [p])."""
    B = kv_indptr.shape[0] - 1
    qo, kv, last = qo_indptr.long().tolist(), kv_indptr.long().tolist(), kv_last_page_lens.long().tolist()
    works, reduce_indptr, final, partial = [], [0], [], []
    for b in range(B):
        pages = kv[b + 1] - kv[b]
        length = (pages - 1) * page_size + last[b] if pages else 0  # tokens
        blocks = max(1, math.ceil(length / kv_granularity))
        cap = max_split_per_batch if max_split_per_batch > 0 else CU_NUM
        n = max(1, min(blocks, cap))
        step = math.ceil(blocks / n) * kv_granularity
        bounds = [(s, min(s + step, length)) for s in range(0, max(length, 1), step)] or [(0, 0)]
        for s, e in bounds:
            pidx = len(partial) if len(bounds) > 1 else -1
            if pidx >= 0:
                partial.append(pidx)
            works.append([b, pidx, qo[b], qo[b + 1], kv[b] + s, kv[b] + e, length - e, heads << 16])
        reduce_indptr.append(len(partial))
        final.append([qo[b], 0])
    total = len(works)
    per = max(1, math.ceil(total / CU_NUM))
    work_indptr = [min(i * per, total) for i in range(CU_NUM + 1)]
    i32 = dict(dtype=torch.int32)
    return (torch.tensor(works, **i32).reshape(-1, 8), torch.tensor(work_indptr, **i32),
            torch.tensor(reduce_indptr, **i32), torch.tensor(final, **i32).reshape(-1, 2), torch.tensor(partial, **i32))  # fmt: skip


def get_mla_metadata_v1(seqlens_qo_indptr, seqlens_kv_indptr, kv_last_page_lens, num_heads_per_head_k, num_heads_k,
                        is_causal, work_metadata_ptrs, work_info_set, work_indptr, reduce_indptr, reduce_final_map,
                        reduce_partial_map, page_size=1, kv_granularity=16, max_seqlen_qo=-1, uni_seqlen_qo=-1,
                        fast_mode=True, topk=-1, max_split_per_batch=-1, intra_batch_mode=False,
                        is_cp_round_robin=False, mla_version=0, dtype_q_nope=None, dtype_q_rope=None,
                        dtype_kv_nope=None, dtype_kv_rope=None, dtype_q=None, dtype_kv=None):  # fmt: skip
    args = {"num_heads_per_head_k": num_heads_per_head_k, "num_heads_k": num_heads_k, "is_causal": is_causal,
            "page_size": page_size, "kv_granularity": kv_granularity, "max_seqlen_qo": max_seqlen_qo,
            "uni_seqlen_qo": uni_seqlen_qo, "fast_mode": fast_mode, "max_split_per_batch": max_split_per_batch,
            "intra_batch_mode": intra_batch_mode, "is_cp_round_robin": is_cp_round_robin,
            "dtype_q": dtype_q, "dtype_kv": dtype_kv}  # fmt: skip
    METADATA_CALLS.append({"fn": "get_mla_metadata_v1", **args})
    for name, t in (("seqlens_qo_indptr", seqlens_qo_indptr), ("seqlens_kv_indptr", seqlens_kv_indptr),
                    ("kv_last_page_lens", kv_last_page_lens), ("work_info_set", work_info_set),
                    ("work_indptr", work_indptr), ("reduce_indptr", reduce_indptr),
                    ("reduce_final_map", reduce_final_map), ("reduce_partial_map", reduce_partial_map)):  # fmt: skip
        _need(isinstance(t, torch.Tensor) and t.dtype == torch.int32, f"{name} must be an int32 tensor")
    _need(work_metadata_ptrs.numel() == 2, "work_metadata_ptrs must hold 2 entries")
    _need(num_heads_k == 1 and num_heads_per_head_k % 16 == 0, f"heads {num_heads_per_head_k}/{num_heads_k}")
    _need(work_info_set.dim() == 2 and work_info_set.shape[1] == 8, "work_info_set must be [works, 8]")
    _need(reduce_final_map.dim() == 2 and reduce_final_map.shape[1] == 2, "reduce_final_map must be [tiles, 2]")
    _need(max_seqlen_qo >= 1, f"max_seqlen_qo {max_seqlen_qo}")
    B = seqlens_kv_indptr.shape[0] - 1
    tiles = B * _tiles(max_seqlen_qo, num_heads_per_head_k)
    _need(reduce_indptr.numel() == tiles + 1, f"reduce_indptr has {reduce_indptr.numel()} entries: buffers sized for "
                                              f"another batch or head count (want {tiles + 1})")  # fmt: skip
    _need(work_indptr.numel() == CU_NUM + 1, f"work_indptr has {work_indptr.numel()} entries, want {CU_NUM + 1}")
    w, wi, ri, fm, pm = plan(seqlens_qo_indptr, seqlens_kv_indptr, kv_last_page_lens, num_heads_per_head_k,
                             page_size, kv_granularity, max_split_per_batch)  # fmt: skip
    _need(w.shape[0] <= work_info_set.shape[0], f"{w.shape[0]} works > work_info_set's {work_info_set.shape[0]} rows")
    _need(pm.numel() <= reduce_partial_map.numel(), f"{pm.numel()} partials > reduce_partial_map's {reduce_partial_map.numel()}")
    work_metadata_ptrs.zero_()
    work_info_set[: w.shape[0]] = w
    work_indptr.copy_(wi)
    reduce_indptr.copy_(ri)
    reduce_final_map[: fm.shape[0]] = fm
    reduce_partial_map[: pm.numel()] = pm
    _FILLED[id(work_info_set)] = {**args, "plan": (w, wi, ri, fm, pm)}


def check_persistent(q, qo_indptr, kv_indptr, kv_last_page_lens, buffers: dict, intra_batch_mode, num_kv_splits):
    """mla_decode_fwd in persistent mode: the buffers were filled for this call. Returns the record."""
    missing = [k for k, v in buffers.items() if v is None]
    _need(not missing, f"persistent mode needs all six work buffers; missing {missing}")
    filled = _FILLED.get(id(buffers["work_info_set"]))
    _need(filled is not None, "work buffers were not filled by get_mla_metadata_v1")
    _need(filled["num_heads_per_head_k"] == q.shape[1],
          f"metadata built for {filled['num_heads_per_head_k']} heads, q has {q.shape[1]}")  # fmt: skip
    _need(bool(intra_batch_mode) == bool(filled["intra_batch_mode"]),
          f"intra_batch_mode {intra_batch_mode} != the metadata's {filled['intra_batch_mode']}")  # fmt: skip
    _need(num_kv_splits is None or num_kv_splits == filled["max_split_per_batch"],
          f"num_kv_splits {num_kv_splits} != the metadata's max_split_per_batch {filled['max_split_per_batch']}")  # fmt: skip
    now = plan(qo_indptr, kv_indptr, kv_last_page_lens, q.shape[1], filled["page_size"], filled["kv_granularity"],
               filled["max_split_per_batch"])  # fmt: skip
    _need(all(torch.equal(a, b) for a, b in zip(now, filled["plan"])), "work buffers were built for other indptrs")
    return filled
