"""What a ``refmla.capture/1`` file holds (docs/contract.md section 1): its tensors, its meta keys,
and the :class:`Capture` they load into.

A new tensor goes in :data:`TENSORS` and :class:`Capture`; a new meta key in :data:`META_KEYS` and
:class:`CaptureMeta`, with its bounds as one more function in :data:`META_CHECKS`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Callable, Mapping, Optional

import torch

from refmla import CAPTURE_FORMAT
from refmla.arithmetic import LSE_BASE_ALIASES, lse_base_of
from refmla.attended import Attended
from refmla.capture.numbers import MAX_HEADS, MAX_KV_SPLITS, MAX_PAGE, META_NUMBERS, meta_number_problems
from refmla.scales import Scales
from refmla.schedule import MIN_BLOCK_KV, SPLIT_BLOCKS
from refmla.util import printable, request_label

FLOAT_DTYPES = {
    torch.bfloat16, torch.float16, torch.float32, torch.float64,
    torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2, torch.float8_e5m2fnuz,
}  # fmt: skip
INDEX_DTYPES = {torch.int32, torch.int64}

# name -> required; shapes and dtypes are checked in refmla.capture.validation
TENSORS = {
    "q": True, "kv_buffer": True, "kv_indptr": True, "kv_indices": True, "seq_lens": True,
    "num_kv_splits": False, "out": False, "lse": False, "attn_logits": False, "attn_lse": False,
    "req_to_token": False, "orig_kv_indices": False, "qo_indptr": False,
    "custom_mask": False, "mask_indptr": False,
    # aiter's persistent work buffers as production's kernel read them (docs/contract.md section 1)
    "aiter_work_indptr": False, "aiter_work_info_set": False, "aiter_reduce_indptr": False,
    "aiter_reduce_final_map": False, "aiter_reduce_partial_map": False,
    # block-table kernels (vLLM, FlashMLA, FlashInfer / TRT-LLM, CUTLASS MLA, FA3): the table the
    # kernel got and vLLM's multi-token decode rows (docs/contract.md section 1, "block tables")
    "block_table": False, "query_start_loc": False,
    # FlashMLA's tile-scheduler plan as its decode read it (docs/contract.md section 1, "FlashMLA plan")
    "flashmla_tile_scheduler_metadata": False, "flashmla_num_splits": False,
    # decode context parallelism: the combined output of this rank's heads (docs/context-parallel.md)
    "dcp_out": False,
    # what each attended row holds and where it came from, like kv_indices (refmla.capture.rows)
    "kv_token_ids": False, "kv_origin": False,
    # ... and the combine's inputs as it was handed them (the rank's out and lse, their own dtypes)
    "dcp_in_out": False, "dcp_in_lse": False,
}  # fmt: skip
# without kv_indptr / kv_indices, a capture with a block_table has them built by the reader
BUILT_FROM_BLOCK_TABLE = ("kv_indptr", "kv_indices")
SPLIT_SCHEDULES = tuple(SPLIT_BLOCKS)  # meta split_schedule: "sglang" (default) or "uniform" (vLLM)

MODES = ("decode", "extend", "verify")  # verify: speculative target-verify / draft-extend (several queries)
MASK_DTYPES = {torch.bool, torch.uint8, torch.int8}  # custom_mask as SGLang keeps it (bool) or its int8 buffer


class CaptureError(ValueError):
    """Invalid or unusable input: names the file and the tensor or key. A ValueError, as the Python
    API promises for bad input (refmla/api.py)."""

    def __init__(self, path: Any, key: str, message: str):
        self.path, self.key, self.message = str(path), key, message
        super().__init__(printable(f"{self.path}: {key}: {message}"))

    @classmethod
    def of_line(cls, path: Any, line: str) -> "CaptureError":
        """The error whose message is ``line`` (the file named first, as the command line prints it)."""
        e = cls.__new__(cls)
        e.path, e.key, e.message = str(path), "", line
        ValueError.__init__(e, printable(line if line.startswith(str(path)) else f"{path}: {line}"))
        return e


# --------------------------------------------------------------------------------------------
# meta
# --------------------------------------------------------------------------------------------


@dataclass
class CaptureMeta:
    mode: str  # "decode" (one query token per request), "extend" or "verify" (speculative, see MODES)
    backend: str  # production backend that produced `out`: triton | aiter | unknown
    kv_lora_rank: int  # Dv, latent (value) width
    qk_rope_head_dim: int  # rope width; D = kv_lora_rank + qk_rope_head_dim
    sm_scale: float  # softmax scale exactly as passed to the kernel
    logit_cap: float  # tanh soft cap, 0 = off
    page_size: int  # production pool page size (indices are token level)
    k_scale: float = 1.0
    v_scale: float = 1.0
    max_kv_splits: Optional[int] = None
    layer_id: Optional[int] = None
    tp_rank: Optional[int] = None
    step: Optional[int] = None
    rids: Optional[list] = None
    sglang_version: Optional[str] = None
    aiter_version: Optional[str] = None
    draft_token_num: Optional[int] = None  # verify: query tokens per request in SGLang's target_verify
    topk: Optional[int] = None  # verify: EAGLE topk (1: a chain, > 1: a tree with custom_mask)
    # the production pool's geometry (docs/contract.md section 1, "pool geometry"; refmla.region_check)
    kv_pool_rows: Optional[int] = None  # rows of one registered KV buffer (SGLang: max_total_num_tokens + page_size)
    kv_pool_row_bytes: Optional[int] = None  # bytes of one row of one layer (kv_cache_dim x element size)
    kv_pool_layers_per_buffer: Optional[int] = None  # layers one registered buffer holds (MLATokenToKVPool: 1)
    kv_pool_layers: Optional[int] = None  # layers of the pool on this rank
    kv_pool_size: Optional[int] = None  # the pool's token capacity (SGLang's max_total_num_tokens)
    disagg_mode: Optional[str] = None  # "prefill" | "decode" | "null"
    disagg_transfer_backend: Optional[str] = None  # "mori" | "mooncake" | "nixl" | ...
    mori_max_mr_bytes: Optional[int] = None  # SGLANG_MORI_MAX_MR_BYTES, when it was set
    # every buffer the pool registers, from its own get_contiguous_buf_infos() (any pool class)
    kv_pool_class: Optional[str] = None  # the pool's class name (MLATokenToKVPool, DeepSeekV4TokenToKVPool, ...)
    kv_pool_region_bytes: Optional[list] = None  # data_lens: bytes of each registered buffer
    kv_pool_region_item_bytes: Optional[list] = None  # item_lens: bytes of one transfer item (one page) of each
    kv_pool_page_size: Optional[int] = None  # tokens one transfer item holds (the pool's page_size)
    engine: Optional[str] = None  # "sglang" | "vllm": the serving engine the hook ran in
    engine_version: Optional[str] = None  # its version (sglang_version stays for SGLang captures)
    engine_backend: Optional[str] = None  # the engine's own backend name, e.g. vLLM's "TRITON_MLA"
    split_schedule: Optional[str] = None  # "sglang" (None: ceil to 32 tokens) | "uniform" (vLLM: ceil(L / n))
    null_block: Optional[int] = None  # block_table captures: the engine's null block id (vLLM: 0)
    # decode context parallelism (docs/context-parallel.md): this rank's shard of every request
    dcp_world_size: Optional[int] = None  # ranks the KV is sharded over (vLLM's dcp_world_size)
    dcp_rank: Optional[int] = None  # this rank (0 <= dcp_rank < dcp_world_size)
    dcp_interleave_size: Optional[int] = None  # positions per run dealt to a rank (cp_kv_cache_interleave_size)
    dcp_tot_seq_lens: Optional[list] = None  # each request's whole length (seq_lens are the rank's)
    extra: dict = field(default_factory=dict)  # keys this version does not know, kept as given

    @property
    def head_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    def to_json(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "extra"}
        d = {k: v for k, v in d.items() if v is not None}
        return {**self.extra, **d}


# The sane ranges validation enforces (docs/contract.md section 1, "Bounds"). sm_scale: the real
# ones are 1/sqrt(D) times a yarn mscale**2, 0.04..0.3 for DeepSeek-V3 / Kimi-K2; 1e-6..1e3 admits
# any head dim up to 1e12 and any mscale a model uses, while keeping scale * logit finite in fp32.
# k_scale / v_scale: fp8 dequant scales are amax / 448 (or / 240), 1e-9..1e9 covers any amax.
SCALE_RANGE = {key: META_NUMBERS[key][1:] for key in ("sm_scale", "k_scale", "v_scale")}
MAX_PAGE_SIZE = MAX_PAGE  # the numeric bounds of every meta key: refmla.capture.numbers.META_NUMBERS

# key -> (type, required); int keys accept integral floats, float keys accept ints
META_KEYS = {
    "mode": (str, True), "backend": (str, True), "kv_lora_rank": (int, True),
    "qk_rope_head_dim": (int, True), "sm_scale": (float, True), "logit_cap": (float, True),
    "page_size": (int, True), "k_scale": (float, False), "v_scale": (float, False),
    "max_kv_splits": (int, False), "layer_id": (int, False), "tp_rank": (int, False),
    "step": (int, False), "rids": (list, False), "sglang_version": (str, False),
    "aiter_version": (str, False),
    "kv_pool_rows": (int, False), "kv_pool_row_bytes": (int, False), "kv_pool_layers_per_buffer": (int, False),
    "kv_pool_layers": (int, False), "kv_pool_size": (int, False), "disagg_mode": (str, False),
    "disagg_transfer_backend": (str, False), "mori_max_mr_bytes": (int, False),
    "draft_token_num": (int, False), "topk": (int, False),
    "kv_pool_class": (str, False), "kv_pool_region_bytes": (list, False), "kv_pool_region_item_bytes": (list, False),
    "kv_pool_page_size": (int, False),
    "engine": (str, False), "engine_version": (str, False), "engine_backend": (str, False),
    "split_schedule": (str, False), "null_block": (int, False),
    "dcp_world_size": (int, False), "dcp_rank": (int, False), "dcp_interleave_size": (int, False),
    "dcp_tot_seq_lens": (list, False),
}  # fmt: skip
MAX_META_DEPTH = 32  # nesting of a meta value (lists / objects): production's are 1 deep; the JSON encoder recurses
INT_RANGE = (-(2**63), 2**63)  # every int key fits int64: sizes multiply, and tensors / floats are made of them
GEOMETRY_KEYS = ("kv_pool_rows", "kv_pool_row_bytes", "kv_pool_layers_per_buffer")  # what refmla.region_check needs


def parse_meta(raw: Mapping[str, Any], path: Any = "<meta>") -> CaptureMeta:
    """Validate the ``meta`` JSON object and build a CaptureMeta."""
    if not isinstance(raw, Mapping):
        raise CaptureError(path, "meta", "must be a JSON object")
    _check_depth(raw, path)
    check_meta_numbers(raw, path)
    kw: dict[str, Any] = {}
    for key, (typ, required) in META_KEYS.items():
        if key not in raw or raw[key] is None:
            if required:
                raise CaptureError(path, f"meta key '{key}'", "missing")
            continue
        kw[key] = _coerce(raw[key], typ, path, key)
    for check in META_CHECKS:
        check(kw, path)
    if "rids" in kw:
        kw["rids"] = [str(r) for r in kw["rids"]]
        _check_unique_rids(kw["rids"], path)
    extra = {k: v for k, v in raw.items() if k not in META_KEYS and k != "format"}
    if "lse_base" in extra and lse_base_of(extra["lse_base"]) is None:
        raise _bad_key(path, "lse_base", f"must be one of {', '.join(LSE_BASE_ALIASES)}, got {extra['lse_base']!r}")
    return CaptureMeta(**kw, extra=extra)


def check_meta_numbers(raw: Mapping[str, Any], path: Any) -> None:
    """CaptureError naming the file and the first meta key whose number breaks its type, finiteness
    or range (refmla.capture.numbers.META_NUMBERS): every capture kind's reader calls it on the raw meta."""
    for key, problem in meta_number_problems(raw):
        raise _bad_key(path, key, problem)


def _check_depth(raw: Mapping[str, Any], path: Any) -> None:
    """No meta value nested deeper than MAX_META_DEPTH (an iterative walk: never a RecursionError)."""
    todo = [(key, value, 1) for key, value in raw.items()]
    while todo:
        key, value, depth = todo.pop()
        if depth > MAX_META_DEPTH:
            raise _bad_key(path, str(key), f"nested deeper than {MAX_META_DEPTH} levels")
        if isinstance(value, Mapping):
            todo += [(key, v, depth + 1) for v in value.values()]
        elif isinstance(value, list):
            todo += [(key, v, depth + 1) for v in value]


def _check_unique_rids(rids: list[str], path: Any) -> None:
    """Each request once: a repeated rid would pair (diff-kv, disagg, series) one request and drop the other."""
    seen: dict[str, int] = {}
    for i, rid in enumerate(rids):
        if rid in seen:
            raise _bad_key(path, "rids", f"rids[{i}]={rid!r} repeats rids[{seen[rid]}]: each request appears once")
        seen[rid] = i


def _coerce(value: Any, typ: type, path: Any, key: str) -> Any:
    bad = CaptureError(path, f"meta key '{key}'", f"must be {typ.__name__}, got {_short(value)}")
    if isinstance(value, bool):
        raise bad
    if typ is int:
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if not isinstance(value, int):
            raise bad
        if not INT_RANGE[0] <= value < INT_RANGE[1]:
            raise CaptureError(path, f"meta key '{key}'", f"{_short(value)} does not fit int64 (|value| < 2**63)")
    elif typ is float:
        if not isinstance(value, (int, float)):
            raise bad
        if isinstance(value, int) and not INT_RANGE[0] <= value < INT_RANGE[1]:
            raise CaptureError(path, f"meta key '{key}'", f"{_short(value)} is too large for a float")
        return float(value)
    elif not isinstance(value, typ):
        raise bad
    return value


def _short(value: Any) -> str:
    """repr of a meta value, cut to 60 characters (a 400-digit int, a 900-deep list)."""
    text = repr(value) if not isinstance(value, (list, dict)) else type(value).__name__
    return text if len(text) <= 60 else text[:57] + "..."


def _bad_key(path: Any, key: str, message: str) -> CaptureError:
    return CaptureError(path, f"meta key '{key}'", message)


def _check_mode(kw: dict, path: Any) -> None:
    if kw["mode"] not in MODES:
        raise _bad_key(path, "mode", f"must be one of {', '.join(MODES)}, got {kw['mode']!r}")


def _check_engine_keys(kw: dict, path: Any) -> None:
    schedule = kw.get("split_schedule")
    if schedule is not None and schedule not in SPLIT_SCHEDULES:
        raise _bad_key(path, "split_schedule", f"must be one of {', '.join(SPLIT_SCHEDULES)}, got {schedule!r}")


def _check_geometry(kw: dict, path: Any) -> None:
    for key in (*GEOMETRY_KEYS, "kv_pool_layers", "mori_max_mr_bytes"):
        if kw.get(key) is not None and kw[key] < 1:
            raise _bad_key(path, key, f"must be >= 1, got {kw[key]}")
    if kw.get("kv_pool_size") is not None and kw["kv_pool_size"] < 0:
        raise _bad_key(path, "kv_pool_size", f"must be >= 0, got {kw['kv_pool_size']}")
    _check_regions(kw, path)


def _check_regions(kw: dict, path: Any) -> None:
    """kv_pool_region_bytes / _item_bytes: equal-length lists of ints (bytes >= 0, items >= 1), both or neither."""
    lens, items = kw.get("kv_pool_region_bytes"), kw.get("kv_pool_region_item_bytes")
    if (lens is None) != (items is None):
        key = "kv_pool_region_item_bytes" if items is None else "kv_pool_region_bytes"
        raise _bad_key(path, key, "missing: kv_pool_region_bytes and kv_pool_region_item_bytes come together")
    if lens is None:
        return
    for key, values, low in (("kv_pool_region_bytes", lens, 0), ("kv_pool_region_item_bytes", items, 1)):
        if not values or any(isinstance(v, bool) or not isinstance(v, int) or v < low for v in values):
            raise _bad_key(path, key, f"must be a non-empty list of ints >= {low}, got {values!r}")
    if len(lens) != len(items):
        raise _bad_key(path, "kv_pool_region_item_bytes", f"has {len(items)} entries, kv_pool_region_bytes {len(lens)}")
    if kw.get("kv_pool_page_size") is not None and kw["kv_pool_page_size"] < 1:
        raise _bad_key(path, "kv_pool_page_size", f"must be >= 1, got {kw['kv_pool_page_size']}")


# bounds on the coerced values beyond META_NUMBERS' (checked first, on the raw meta), run in
# order; each raises CaptureError naming the key
META_CHECKS: tuple[Callable[[dict, Any], None], ...] = (
    _check_mode,
    _check_geometry,
    _check_engine_keys,
)


# --------------------------------------------------------------------------------------------
# The loaded capture
# --------------------------------------------------------------------------------------------


@dataclass
class Capture:
    """One captured attention call. Tensors keep the dtypes they were stored with."""

    path: str
    meta: CaptureMeta
    q: torch.Tensor  # [B, H, D] decode, [T, H, D] extend
    kv_buffer: torch.Tensor  # [N, 1, D]
    kv_indptr: torch.Tensor  # [B + 1]
    kv_indices: torch.Tensor  # [kv_indptr[-1]]
    seq_lens: torch.Tensor  # [B]
    num_kv_splits: Optional[torch.Tensor] = None  # [B]
    out: Optional[torch.Tensor] = None  # [B, H, Dv] / [T, H, Dv], the production output
    lse: Optional[torch.Tensor] = None  # [B, H] / [T, H]
    attn_logits: Optional[torch.Tensor] = None  # [B, H, S, Dv]
    attn_lse: Optional[torch.Tensor] = None  # [B, H, S]
    req_to_token: Optional[torch.Tensor] = None  # [B, M]
    orig_kv_indices: Optional[torch.Tensor] = None  # like kv_indices
    qo_indptr: Optional[torch.Tensor] = None  # [B + 1], extend and verify
    custom_mask: Optional[torch.Tensor] = None  # [sum_b n_b * L_b] verify: request b's [n_b, L_b] mask, row-major
    mask_indptr: Optional[torch.Tensor] = None  # [B + 1] verify: request b's mask is custom_mask[mask_indptr[b]:...]
    aiter_work_indptr: Optional[torch.Tensor] = None  # [cu + 1] int32, aiter persistent path
    aiter_work_info_set: Optional[torch.Tensor] = None  # [works, 8]
    aiter_reduce_indptr: Optional[torch.Tensor] = None  # [tiles + 1]
    aiter_reduce_final_map: Optional[torch.Tensor] = None  # [tiles, 2]
    aiter_reduce_partial_map: Optional[torch.Tensor] = None  # [partials]
    block_table: Optional[torch.Tensor] = None  # [B, M] page numbers (kv_buffer rows / page_size)
    query_start_loc: Optional[torch.Tensor] = None  # [B + 1] vLLM: request b's query rows
    flashmla_tile_scheduler_metadata: Optional[torch.Tensor] = None  # [P, 8] int32 (refmla.flashmla_plan)
    flashmla_num_splits: Optional[torch.Tensor] = None  # [B + 1] int32, cumulative splits per request
    dcp_out: Optional[torch.Tensor] = None  # [B, H / dcp_world_size, Dv] the combine's output, this rank's heads
    kv_token_ids: Optional[torch.Tensor] = None  # like kv_indices: the token id of each position's row (refmla.capture.rows)
    kv_origin: Optional[torch.Tensor] = None  # like kv_indices: how each row got into the pool (refmla.capture.rows.ORIGINS)
    dcp_in_out: Optional[torch.Tensor] = None  # [B, H, Dv] the partial out the combine was handed
    dcp_in_lse: Optional[torch.Tensor] = None  # [B, H] the lse the combine was handed (any float dtype, base lse_base)
    warnings: list = field(default_factory=list)
    _attended: Optional[tuple] = field(default=None, init=False, repr=False, compare=False)

    @property
    def batch_size(self) -> int:
        return self.kv_indptr.shape[0] - 1

    @property
    def num_heads(self) -> int:
        return self.q.shape[1]

    @property
    def is_decode(self) -> bool:
        return self.meta.mode == "decode"

    @property
    def is_verify(self) -> bool:
        return self.meta.mode == "verify"

    def mask_args(self) -> dict[str, Optional[torch.Tensor]]:
        """custom_mask / mask_indptr as keyword arguments: the verify tree mask, None otherwise."""
        on = self.is_verify and self.custom_mask is not None
        return {"custom_mask": self.custom_mask if on else None, "mask_indptr": self.mask_indptr if on else None}

    def tensors(self) -> dict[str, torch.Tensor]:
        return {n: getattr(self, n) for n in TENSORS if getattr(self, n) is not None}

    def scales(self) -> Scales:
        """The scalars of this call's math, passed whole to the reference, the control and the backends."""
        m = self.meta
        return Scales(m.kv_lora_rank, m.sm_scale, m.logit_cap, m.k_scale, m.v_scale)

    def attended(self) -> Attended:
        """What each query row reads (:mod:`refmla.attended`), built once (read_capture builds it
        after validation) and rebuilt only when an index tensor is replaced or changed in place."""
        sources = (self.kv_indptr, self.kv_indices, self.qo_indptr, self.custom_mask, self.mask_indptr,
                   self.block_table, self.seq_lens)
        key = tuple((id(t), t._version) if t is not None else None for t in sources)
        if self._attended is None or self._attended[0] != key:
            tree = self.is_verify and self.custom_mask is not None
            if self.block_table is not None and self.is_decode:  # the kernel's own layout (issue 20)
                att = Attended.block_table(self.block_table, self.seq_lens, self.meta.page_size)
            else:
                att = Attended.token_index(
                    self.kv_indptr, self.kv_indices, None if self.is_decode else self.qo_indptr,
                    self.custom_mask if tree else None, self.mask_indptr if tree else None,
                )  # fmt: skip
            self._attended = (key, att)
        return self._attended[1]

    @property
    def split_block(self) -> int:
        """The split granularity of the kernel that ran: 32 (SGLang), 1 (vLLM's uniform schedule)."""
        return SPLIT_BLOCKS.get(self.meta.split_schedule or "sglang", MIN_BLOCK_KV)

    @property
    def out_dtype(self) -> torch.dtype:
        """The dtype a kernel writes this call's output in: the captured ``out``'s when it has one
        (bf16, fp16 or fp32), else q's, else bf16 (an fp8 q)."""
        for t in (self.out, self.q):
            if t is not None and t.dtype.is_floating_point and t.dtype.itemsize in (2, 4):
                return t.dtype
        return torch.bfloat16

    def rid(self, b: Optional[int]) -> Optional[str]:
        """Request b's id from meta ``rids``, or None."""
        rids = self.meta.rids
        return rids[b] if b is not None and rids is not None and 0 <= b < len(rids) else None

    def label(self, b: int) -> str:
        """"request b (rid ...)" for messages."""
        return request_label(b, self.rid(b))

    def request_of_row(self) -> torch.Tensor:
        """Request index of each row of `out` (decode: arange(B); extend / verify: from qo_indptr)."""
        return self.attended().group_of_row


__all__ = [
    "BUILT_FROM_BLOCK_TABLE",
    "CAPTURE_FORMAT",
    "FLOAT_DTYPES",
    "GEOMETRY_KEYS",
    "INDEX_DTYPES",
    "MASK_DTYPES",
    "META_CHECKS",
    "MODES",
    "META_KEYS",
    "MAX_HEADS",
    "MAX_KV_SPLITS",
    "MAX_PAGE_SIZE",
    "SCALE_RANGE",
    "check_meta_numbers",
    "SPLIT_SCHEDULES",
    "TENSORS",
    "Capture",
    "CaptureError",
    "CaptureMeta",
    "parse_meta",
]
