"""The numbers in a capture's meta, for every capture kind (dense, block-table, aiter path, sparse):
each numeric key the code reads, its type and its range (docs/contract.md section 1, "Bounds"),
checked by one function every reader calls before it reads a key
(:func:`refmla.capture.format.check_meta_numbers`, which raises CaptureError naming the key).

:func:`meta_json` parses the ``meta`` text with every integer literal bounded in digits, so an
integer of thousands of digits (past Python's int-string limit) is refused naming its key, not
the file; :func:`check_meta_numbers` refuses a number that is not of its key's type (a bool, a
string, a fractional int), not finite (1e400 reads as inf), or outside its key's range.
"""

from __future__ import annotations

import json
from typing import Any, Mapping

I64 = 2**63 - 1
MAX_PAGE = 1 << 16  # page sizes and widths: SGLang / aiter page sizes are 1..256, widths <= 576
# SGLang's max_kv_splits is max(--triton-attention-num-kv-splits, min(npow2(CUs), npow2(ctx / 32))):
# 256 on MI355X, 512 on the largest GPU; the stage-1 buffer is [B, H, max_kv_splits, Dv + 1] fp32.
MAX_KV_SPLITS = 1 << 12
# q's heads: an MLA model has at most 128 query heads (DeepSeek-V3 at TP1); every path's work and
# buffers scale with them, so a q claiming more is refused before any work (validation, tensor 'q')
MAX_HEADS = 1 << 10
MAX_INT_DIGITS = 40  # an integer literal in meta longer than this fits no key (int64 has 19 digits)

# key -> (type, lowest, highest), both included; int keys accept integral floats, float keys ints.
# One table for every kind: a key two kinds share (page_size, layer_id) has one meaning and one range.
META_NUMBERS: dict[str, tuple[type, float, float]] = {
    # dense decode / extend / verify (refmla.capture.format.CaptureMeta)
    "kv_lora_rank": (int, 1, MAX_PAGE), "qk_rope_head_dim": (int, 0, MAX_PAGE), "page_size": (int, 1, MAX_PAGE),
    "sm_scale": (float, 1e-6, 1e3), "logit_cap": (float, 0.0, 1e30), "k_scale": (float, 1e-9, 1e9),
    "v_scale": (float, 1e-9, 1e9), "max_kv_splits": (int, 1, MAX_KV_SPLITS), "layer_id": (int, 0, I64),
    "tp_rank": (int, 0, I64), "step": (int, 0, I64), "draft_token_num": (int, 1, I64), "topk": (int, 1, I64),
    "null_block": (int, 0, I64),
    "dcp_world_size": (int, 1, MAX_HEADS), "dcp_rank": (int, 0, MAX_HEADS), "dcp_interleave_size": (int, 1, I64),
    # the production pool's geometry (refmla.region_check), any kind
    "kv_pool_rows": (int, 1, I64), "kv_pool_row_bytes": (int, 1, I64), "kv_pool_layers_per_buffer": (int, 1, I64),
    "kv_pool_layers": (int, 1, I64), "kv_pool_size": (int, 0, I64), "mori_max_mr_bytes": (int, 1, I64),
    "kv_pool_page_size": (int, 1, I64),
    # the aiter path (refmla.backends.aiter.paths): -1 is SGLang's "aiter picks" for the split counts
    "aiter_num_kv_splits": (int, -1, MAX_KV_SPLITS), "aiter_max_split_per_batch": (int, -1, MAX_KV_SPLITS),
    "aiter_kernel_heads": (int, 1, MAX_HEADS), "aiter_num_head_padded": (int, 1, MAX_HEADS),
    "aiter_mla_kernel_num_head_padded": (int, 1, MAX_HEADS), "aiter_kv_granularity": (int, 1, MAX_PAGE),
    "aiter_q_scale": (float, 1e-9, 1e9), "aiter_kv_scale": (float, 1e-9, 1e9),
    # sparse decode (refmla.sparse.format.SparseMeta)
    "softmax_scale": (float, 1e-6, 1e3), "head_dim_v": (int, 1, MAX_PAGE), "extra_page_size": (int, 1, MAX_PAGE),
    "compress_ratio": (int, 0, 128), "window": (int, 0, I64),
}  # fmt: skip


class HugeInt(str):
    """An integer literal of more than MAX_INT_DIGITS digits, kept as its text (never converted)."""


def _parse_int(text: str) -> Any:
    return HugeInt(text) if len(text) > MAX_INT_DIGITS else int(text)


def meta_json(text: str) -> Any:
    """``json.loads`` of a meta text, every over-long integer literal a :class:`HugeInt` (refused by
    :func:`check_meta_numbers` naming its key). Raises what json.loads raises otherwise."""
    return json.loads(text, parse_int=_parse_int)


def number_problem(key: str, value: Any) -> str | None:
    """Why ``value`` is not an acceptable meta ``key`` (META_NUMBERS), or None."""
    typ, lo, hi = META_NUMBERS[key]
    if isinstance(value, HugeInt):
        return f"an integer of {len(value.lstrip('-'))} digits is outside [{lo:g}, {hi:g}]"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"must be {typ.__name__}, got {_short(value)}"
    if value != value or value in (float("inf"), float("-inf")):
        return f"must be a finite number in [{lo:g}, {hi:g}], got {value}"
    if typ is int and isinstance(value, float) and not value.is_integer():
        return f"must be int, got {value!r}"
    if not lo <= value <= hi:
        if typ is float:
            return f"must be in [{lo:g}, {hi:g}], got {value:g}"
        return f"must be in [{lo}, {hi}], got {int(value)}"
    return None


def meta_number_problems(raw: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(key, reason) for every number in ``raw`` out of its type or range: an over-long integer
    anywhere (named by its top-level key), then every META_NUMBERS key present and not null."""
    if not isinstance(raw, Mapping):
        return []  # not an object: the reader says so in its own words
    out = []
    for key, value in raw.items():
        if _holds_huge(value):
            out.append((str(key), f"holds an integer of more than {MAX_INT_DIGITS} digits"))
    for key, value in raw.items():
        if key in META_NUMBERS and value is not None and not _holds_huge(value):
            problem = number_problem(key, value)
            if problem:
                out.append((key, problem))
    return out


def _holds_huge(value: Any) -> bool:
    todo = [value]
    while todo:  # iterative: meta depth is bounded by its reader, not by the stack
        v = todo.pop()
        if isinstance(v, HugeInt):
            return True
        if isinstance(v, Mapping):
            todo += list(v.values())
        elif isinstance(v, list):
            todo += v
    return False


def _short(value: Any) -> str:
    text = repr(value) if not isinstance(value, (list, dict)) else type(value).__name__
    return text if len(text) <= 60 else text[:57] + "..."


__all__ = ["MAX_HEADS", "MAX_KV_SPLITS", "MAX_PAGE", "META_NUMBERS", "HugeInt", "meta_json", "meta_number_problems",
           "number_problem"]  # fmt: skip
