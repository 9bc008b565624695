"""The MR region-size check: the largest KV buffer the transfer engine registers as one RDMA
memory region, against the registration limit (docs/contract.md, "the region-size check").

MORI registers each KV buffer of the pool (``get_contiguous_buf_infos``) as one memory region;
registration fails with EINVAL once a region crosses a size limit (measured on MI355X: ~2.19 GB
registers, ~3.9999 GiB does not), and SGLang clamps ``max_total_num_tokens`` with
``SGLANG_MORI_MAX_MR_BYTES`` (default 2 GiB). A region that does not register means KV that never
arrives: the decode node attends over rows the transfer never wrote.

    region bytes = kv_pool_rows x kv_pool_row_bytes x kv_pool_layers_per_buffer   (capture meta)
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
             "transfer_backend": self.transfer_backend, "message": self.message}  # fmt: skip
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


def check_region(meta: CaptureMeta) -> RegionCheck:
    """The region-size check of one capture's meta (see the module docstring)."""
    limit, source = mr_limit(meta)
    rows, row_bytes, lpb = meta.kv_pool_rows, meta.kv_pool_row_bytes, meta.kv_pool_layers_per_buffer
    base: dict[str, Any] = dict(limit_bytes=limit, limit_source=source, page_size=meta.page_size,
                                max_total_num_tokens=meta.kv_pool_size,
                                transfer_backend=meta.disagg_transfer_backend)  # fmt: skip
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
    fit = f"max_total_num_tokens <= {fits} would fit"
    if region >= limit:
        return RegionCheck("finding", f"{what}: at or over the limit, MORI cannot register it "
                           f"(the KV of this layer never arrives); {fit}", **numbers)  # fmt: skip
    if region >= limit * (1 - NEAR_FRACTION):
        return RegionCheck("warning", f"{what}: within {NEAR_FRACTION:.0%} below the limit "
                           f"({100 * region / limit:.2f} %); {fit}", **numbers)  # fmt: skip
    return RegionCheck("ok", f"{what}: {100 * region / limit:.1f} % of the limit", **numbers)
