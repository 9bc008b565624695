"""The MR region-size check: the largest KV buffer the transfer engine registers as one RDMA
memory region, against the registration limit (docs/contract.md, "the region-size check").

MORI registers each KV buffer of the pool (``get_contiguous_buf_infos``) as one memory region;
registration fails with EINVAL once a region crosses a size limit (measured on MI355X: ~2.19 GB
registers, ~3.9999 GiB does not), and SGLang clamps ``max_total_num_tokens`` with
``SGLANG_MORI_MAX_MR_BYTES`` (default 2 GiB). A region that does not register means KV that never
arrives: the decode node attends over rows the transfer never wrote.

    region bytes = max(kv_pool_region_bytes)        the pool's own get_contiguous_buf_infos()
                                                    (any pool class: MLA, DeepSeek-V4, ...)
                 else kv_pool_rows x kv_pool_row_bytes x kv_pool_layers_per_buffer  (older captures)
    limit        = meta mori_max_mr_bytes (SGLANG_MORI_MAX_MR_BYTES as captured), else 2 GiB

    finding       region >= limit
    warning       limit * (1 - 5 %) <= region < limit
    ok            below that
    not_recorded  the capture has no pool geometry: nothing is claimed

Pure functions of the meta; the result is typed (:class:`RegionCheck`) and says, with the
numbers, the ``max_total_num_tokens`` that would fit under the limit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from refmla.capture import CaptureMeta

DEFAULT_MR_LIMIT = 2 << 30  # SGLang's default SGLANG_MORI_MAX_MR_BYTES: 2 GiB
NEAR_FRACTION = 0.05  # within 5 % below the limit: a warning
STATUSES = ("finding", "warning", "ok", "not_recorded")


@dataclass
class RegionCheck:
    status: str  # "finding" | "warning" | "ok" | "not_recorded"
    message: str
    limit_bytes: int
    limit_source: str  # "SGLANG_MORI_MAX_MR_BYTES" (as captured) | "default"
    region_bytes: Optional[int] = None
    rows: Optional[int] = None
    row_bytes: Optional[int] = None
    layers_per_buffer: Optional[int] = None
    page_size: Optional[int] = None
    max_total_num_tokens: Optional[int] = None  # the pool's capacity as captured (kv_pool_size)
    fits_max_total_num_tokens: Optional[int] = None  # the largest capacity (page multiple) under the limit
    transfer_backend: Optional[str] = None
    source: str = "kv_buffer"  # "get_contiguous_buf_infos" (every registered buffer) | "kv_buffer" (older meta)
    regions: Optional[int] = None  # how many buffers the pool registers (source get_contiguous_buf_infos)
    region_index: Optional[int] = None  # which of them is the largest (the one that decides)
    bytes_per_token: Optional[float] = None  # the largest region's bytes per token (item bytes / page size)
    pool_class: Optional[str] = None

    @property
    def is_finding(self) -> bool:
        return self.status == "finding"

    @property
    def ratio(self) -> Optional[float]:
        return None if self.region_bytes is None else self.region_bytes / self.limit_bytes

    def to_json(self) -> dict:
        d = {"check": "mr_region_size", "status": self.status, "region_bytes": self.region_bytes,
             "limit_bytes": self.limit_bytes, "limit_source": self.limit_source, "ratio": self.ratio,
             "rows": self.rows, "row_bytes": self.row_bytes, "layers_per_buffer": self.layers_per_buffer,
             "page_size": self.page_size, "max_total_num_tokens": self.max_total_num_tokens,
             "fits_max_total_num_tokens": self.fits_max_total_num_tokens,
             "transfer_backend": self.transfer_backend, "source": self.source, "regions": self.regions,
             "region_index": self.region_index, "bytes_per_token": self.bytes_per_token,
             "pool_class": self.pool_class, "message": self.message}  # fmt: skip
        return d


def mr_limit(meta: CaptureMeta) -> tuple[int, str]:
    """(limit in bytes, where it came from): the captured SGLANG_MORI_MAX_MR_BYTES, else 2 GiB."""
    if meta.mori_max_mr_bytes is not None:
        return meta.mori_max_mr_bytes, "SGLANG_MORI_MAX_MR_BYTES"
    return DEFAULT_MR_LIMIT, "default"


def fitting_tokens(limit: int, bytes_per_row: int, page_size: int) -> int:
    """The largest max_total_num_tokens T (a multiple of page_size) whose buffer of T + page_size
    rows (SGLang's padded slot page) of ``bytes_per_row`` stays strictly below ``limit``."""
    rows = (limit - 1) // bytes_per_row  # the most rows strictly below the limit
    return max(0, (rows - page_size) // page_size * page_size)


def _gib(n: int) -> str:
    return f"{n} bytes ({n / (1 << 30):.4g} GiB)"


def fitting_tokens_per_item(limit: int, item_bytes: int, page_size: int) -> int:
    """The largest max_total_num_tokens T (a multiple of page_size) whose region of T + page_size
    tokens, at ``item_bytes`` per page of ``page_size`` tokens, stays strictly below ``limit``."""
    tokens = (limit - 1) * page_size // item_bytes  # the most tokens strictly below the limit
    return max(0, (tokens - page_size) // page_size * page_size)


def _verdict(what: str, fit: str, region: int, limit: int, numbers: dict) -> RegionCheck:
    if region >= limit:
        return RegionCheck("finding", f"{what}: at or over the limit, MORI cannot register it "
                           f"(the KV of this layer never arrives); {fit}", **numbers)  # fmt: skip
    if region >= limit * (1 - NEAR_FRACTION):
        return RegionCheck("warning", f"{what}: within {NEAR_FRACTION:.0%} below the limit "
                           f"({100 * region / limit:.2f} %); {fit}", **numbers)  # fmt: skip
    return RegionCheck("ok", f"{what}: {100 * region / limit:.1f} % of the limit", **numbers)


def _check_registered(meta: CaptureMeta, base: dict) -> RegionCheck:
    """The largest of every buffer the pool registers (its own get_contiguous_buf_infos())."""
    lens, items = meta.kv_pool_region_bytes, meta.kv_pool_region_item_bytes
    i = max(range(len(lens)), key=lambda j: lens[j])  # the first of the largest
    page = meta.kv_pool_page_size or meta.page_size
    region, limit = lens[i], base["limit_bytes"]
    per_token = items[i] / page
    fits = fitting_tokens_per_item(limit, items[i], page)
    numbers = dict(region_bytes=region, row_bytes=items[i], page_size=page, fits_max_total_num_tokens=fits,
                   source="get_contiguous_buf_infos", regions=len(lens), region_index=i,
                   bytes_per_token=per_token, pool_class=meta.kv_pool_class,
                   **{k: v for k, v in base.items() if k != "page_size"})  # fmt: skip
    cls = f" of {meta.kv_pool_class}" if meta.kv_pool_class else ""
    what = (f"largest registered KV region {_gib(region)} (buffer {i} of {len(lens)}{cls}, "
            f"{per_token:g} bytes per token: {items[i]} bytes per page of {page}), MR limit {_gib(limit)} "
            f"({'SGLANG_MORI_MAX_MR_BYTES' if base['limit_source'] != 'default' else 'the default'})")  # fmt: skip
    return _verdict(what, f"max_total_num_tokens <= {fits} would fit", region, limit, numbers)


def check_region(meta: CaptureMeta) -> RegionCheck:
    """The region-size check of one capture's meta (see the module docstring)."""
    limit, source = mr_limit(meta)
    rows, row_bytes, lpb = meta.kv_pool_rows, meta.kv_pool_row_bytes, meta.kv_pool_layers_per_buffer
    base: dict[str, Any] = dict(limit_bytes=limit, limit_source=source, page_size=meta.page_size,
                                max_total_num_tokens=meta.kv_pool_size,
                                transfer_backend=meta.disagg_transfer_backend)  # fmt: skip
    if meta.kv_pool_region_bytes:
        return _check_registered(meta, base)
    if rows is None or row_bytes is None:
        missing = [k for k, v in (("kv_pool_rows", rows), ("kv_pool_row_bytes", row_bytes)) if v is None]
        return RegionCheck("not_recorded", f"pool geometry not recorded ({', '.join(missing)} missing in meta): "
                           "the region size was not checked", **base)  # fmt: skip
    lpb = lpb or 1
    region = rows * row_bytes * lpb
    fits = fitting_tokens(limit, row_bytes * lpb, meta.page_size)
    numbers = dict(region_bytes=region, rows=rows, row_bytes=row_bytes, layers_per_buffer=lpb,
                   fits_max_total_num_tokens=fits, **base)  # fmt: skip
    what = (f"largest registered KV region {_gib(region)} = {rows} rows x {row_bytes} bytes x {lpb} layer(s), "
            f"MR limit {_gib(limit)} ({'SGLANG_MORI_MAX_MR_BYTES' if source != 'default' else 'the default'})")  # fmt: skip
    return _verdict(what, f"max_total_num_tokens <= {fits} would fit", region, limit, numbers)


def compressed_bytes_per_token(row_bytes: int, compress_ratio: int) -> Optional[float]:
    """Bytes per token of a compressed KV region: one row of ``row_bytes`` per ``compress_ratio``
    tokens (DeepSeek-V4's C4 / C128 caches). Ratio 0 is a dense (window-only) layer: it has no
    compressed region, so None, never a division by zero."""
    return None if compress_ratio <= 0 else row_bytes / compress_ratio


def compressed_regions(tokens: int, page_size: int, row_bytes: int, ratios: list[int]) -> dict[str, Any]:
    """The meta of a pool that registers one compressed buffer per layer with a ratio > 0 (what
    DeepSeek-V4's unified pool hands the transfer engine): kv_pool_region_bytes / _item_bytes."""
    lens, items = [], []
    for ratio in ratios:
        per_token = compressed_bytes_per_token(row_bytes, ratio)
        if per_token is not None:
            lens.append(int(tokens * per_token))
            items.append(int(page_size * per_token))
    return {"kv_pool_region_bytes": lens, "kv_pool_region_item_bytes": items, "kv_pool_page_size": page_size,
            "kv_pool_size": tokens}  # fmt: skip


@dataclass
class PoolMeta:
    """The pool-geometry keys of any capture's meta (a sparse capture keeps them among its extra
    keys), for :func:`check_region` when there is no dense CaptureMeta."""

    page_size: int = 1
    kv_pool_rows: Optional[int] = None
    kv_pool_row_bytes: Optional[int] = None
    kv_pool_layers_per_buffer: Optional[int] = None
    kv_pool_size: Optional[int] = None
    kv_pool_region_bytes: Optional[list] = None
    kv_pool_region_item_bytes: Optional[list] = None
    kv_pool_page_size: Optional[int] = None
    kv_pool_class: Optional[str] = None
    mori_max_mr_bytes: Optional[int] = None
    disagg_transfer_backend: Optional[str] = None

    @classmethod
    def from_raw(cls, raw: dict) -> "PoolMeta":
        """The known keys of ``raw`` (validated as parse_meta does: a bad one raises CaptureError)."""
        from refmla.capture.format import _check_geometry

        kw = {k: raw[k] for k in cls.__dataclass_fields__ if raw.get(k) is not None}
        _check_geometry(dict(kw), "<meta>")
        return cls(**kw)
