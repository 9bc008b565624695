"""The MR region-size check: every KV buffer the transfer engine registers as one RDMA memory
region, against SGLang's clamp and what is measured of MORI's limit (docs/contract.md, section 8).

MORI registers each KV buffer of the pool (``get_contiguous_buf_infos``) as one memory region;
``RegisterRdmaMemoryRegion`` fails with EINVAL once a region crosses a size limit that is known
only from runs (:data:`MEASURED`, the one table of them). SGLang's clamp is another number: it
lowers ``max_total_num_tokens`` so that every region stays under ``SGLANG_MORI_MAX_MR_BYTES``
(default 2 GiB), a safety margin well below the measured ceiling, not the ceiling itself. A region
that does not register means KV that never arrives.

    tokens T       the pool's capacity (max_total_num_tokens; a capture's kv_pool_size)
    region(T)      T x bytes_per_token              the buffer's bytes as the seed's runs report them
    clamp          SGLANG_MORI_MAX_MR_BYTES (as captured / given), else 2 GiB
    cap(clamp)     the largest page multiple T with (T + page_size) x bytes_per_token < clamp
                   (SGLang's padded page; at a 4 GiB clamp it gives 16,776,704 tokens, the very
                   4,294,836,224-byte region measured to fail: :func:`clamp_tokens`, the one formula)

    band (per buffer, the largest decides)        status        exit (inspect, disagg, regions)
    fails          region >= the smallest measured to fail     finding   1
    unmeasured     between the largest measured to register      warning   unchanged
                   and the smallest measured to fail
    registers      over the clamp, <= the largest measured to register       ok
    under_clamp    T <= cap(clamp) and <= the largest registered             ok
    not_recorded   the capture has no pool geometry: nothing is claimed

Pure functions of the meta (or of a model's buffers, :func:`plan_regions`); the result is typed
(:class:`RegionCheck`, one :class:`BufferBand` per buffer).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from refmla.capture import CaptureMeta

DEFAULT_MR_LIMIT = 2 << 30  # SGLang's default SGLANG_MORI_MAX_MR_BYTES (its clamp): 2 GiB
STATUSES = ("finding", "warning", "ok", "not_recorded")  # worst first
BANDS = ("fails", "unmeasured", "registers", "under_clamp", "not_recorded")  # worst first
BAND_STATUS = {"fails": "finding", "unmeasured": "warning", "registers": "ok", "under_clamp": "ok",
               "not_recorded": "not_recorded"}  # fmt: skip


@dataclass(frozen=True)
class Measured:
    """One MORI registration measured on hardware: a region of ``region_bytes`` did or did not register."""

    region_bytes: int
    registered: bool
    where: str  # the run: hardware, date, model, tokens x bytes per token
    transfer_backend: str = "mori"  # whose registration was measured


# The one table of what is measured (docs/contract.md section 8 prints the same rows). Between the
# largest that registered and the smallest that failed, nothing is known.
MEASURED = (
    Measured(8_551_168 * 256, True, "MI355X, MORI, SGLang nightly 1P1D disagg of 2026-07-01 (green): "
             "DeepSeek-V4-Flash C4 KV buffer, max_total_num_tokens 8,551,168 x 256 B/token (~2.19 GB, 2.039 GiB)"),
    Measured(4_294_836_224, False, "MI355X, MORI: RegisterRdmaMemoryRegion errno 22 (EINVAL) at 16,776,704 tokens "
             "x 256 B/token (~3.9999 GiB), the region a 4 GiB SGLANG_MORI_MAX_MR_BYTES clamp gives"),
    Measured(23_448_064 * 256, False, "MI355X, MORI, SGLang nightly 1P1D disagg of 2026-07-02 (red): "
             "DeepSeek-V4-Flash C4 KV buffer, max_total_num_tokens 23,448,064 x 256 B/token (~6.0 GB)"),
)  # fmt: skip
LARGEST_REGISTERED = max(m.region_bytes for m in MEASURED if m.registered)
SMALLEST_FAILED = min(m.region_bytes for m in MEASURED if not m.registered)
MEASURED_BACKENDS = frozenset(m.transfer_backend for m in MEASURED)  # {"mori"}


def measured_for(transfer_backend: Optional[str]) -> bool:
    """Whether the table holds figures for this transfer backend; a capture that does not record its
    backend is judged by MORI's (the check is MORI's), any other backend by none."""
    return transfer_backend is None or transfer_backend in MEASURED_BACKENDS


def clamp_tokens(clamp: int, item_bytes: int, page_size: int) -> int:
    """SGLang's clamp of max_total_num_tokens (the one formula): the largest multiple T of
    ``page_size`` whose T + page_size tokens, at ``item_bytes`` per page, stay strictly below
    ``clamp``."""
    tokens = (clamp - 1) * page_size // item_bytes  # the most tokens strictly below the clamp
    return max(0, (tokens - page_size) // page_size * page_size)


def fitting_tokens(limit: int, bytes_per_row: int, page_size: int) -> int:
    """:func:`clamp_tokens` for one row per token (older captures: ``bytes_per_row`` per token)."""
    return clamp_tokens(limit, bytes_per_row * page_size, page_size)



def size_text(n: int, against: Optional[int] = None) -> str:
    """``n`` bytes with its GB / GiB, rounded so that it never reads as equal to ``against`` nor as a
    whole GiB it is not (more digits until they differ): an over never reads as the limit."""
    digits = 3

    def looks_equal(d: int) -> bool:
        text = f"{n / 2**30:.{d}f}"
        same = against is not None and n != against and text == f"{against / 2**30:.{d}f}"
        return same or (n % 2**30 != 0 and float(text) == round(n / 2**30))

    while digits < 12 and looks_equal(digits):
        digits += 1
    return f"{n} bytes ({n / 1e9:.2f} GB, {n / 2**30:.{digits}f} GiB)"


@dataclass
class BufferBand:
    """One registered buffer (or ``count`` alike, e.g. one per layer) and its band."""

    name: str  # "buffer 3" (a capture) | "C4 KV" (a model's pool)
    region_bytes: int
    item_bytes: int  # bytes of one page of page_size tokens
    page_size: int
    band: str  # BANDS
    tokens: Optional[int] = None  # the pool's max_total_num_tokens
    clamp_tokens: Optional[int] = None  # what SGLang's clamp takes max_total_num_tokens to for this buffer
    count: int = 1  # how many buffers of this size the pool registers

    @property
    def bytes_per_token(self) -> float:
        return self.item_bytes / self.page_size

    def to_json(self) -> dict:
        return {"name": self.name, "count": self.count, "region_bytes": self.region_bytes, "item_bytes": self.item_bytes,
                "page_size": self.page_size, "bytes_per_token": self.bytes_per_token, "tokens": self.tokens,
                "band": self.band, "status": BAND_STATUS[self.band], "clamp_tokens": self.clamp_tokens}  # fmt: skip


@dataclass
class RegionCheck:
    status: str  # "finding" | "warning" | "ok" | "not_recorded"
    message: str
    limit_bytes: int  # SGLang's clamp (SGLANG_MORI_MAX_MR_BYTES, else 2 GiB); not MORI's limit
    limit_source: str  # "SGLANG_MORI_MAX_MR_BYTES" (as captured / given) | "default"
    region_bytes: Optional[int] = None
    rows: Optional[int] = None
    row_bytes: Optional[int] = None
    layers_per_buffer: Optional[int] = None
    page_size: Optional[int] = None
    max_total_num_tokens: Optional[int] = None  # the pool's capacity as captured (kv_pool_size)
    fits_max_total_num_tokens: Optional[int] = None  # SGLang's clamp of it (clamp_tokens)
    transfer_backend: Optional[str] = None
    source: str = "kv_buffer"  # "get_contiguous_buf_infos" | "kv_buffer" (older meta) | "model" (refmla regions)
    regions: Optional[int] = None  # how many buffers the pool registers
    region_index: Optional[int] = None  # which of them is the largest (the one that decides)
    bytes_per_token: Optional[float] = None  # the largest region's bytes per token (item bytes / page size)
    pool_class: Optional[str] = None
    band: str = "not_recorded"  # BANDS: the largest buffer's
    buffers: list[BufferBand] = field(default_factory=list)  # every registered buffer (alike ones counted)

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
             "pool_class": self.pool_class, "band": self.band, "clamp_bytes": self.limit_bytes,
             "largest_registered_bytes": LARGEST_REGISTERED, "smallest_failed_bytes": SMALLEST_FAILED,
             "buffers": [b.to_json() for b in self.buffers], "message": self.message,
             # added: limit_bytes is SGLang's clamp, not MORI's limit (known only as the measured
             # bounds above, which are MORI's and apply to this check only when measured_applies)
             "sglang_clamp_bytes": self.limit_bytes, "measured_transfer_backend": "mori",
             "measured_applies": measured_for(self.transfer_backend)}  # fmt: skip
        return d


def mr_limit(meta: Any) -> tuple[int, str]:
    """(SGLang's clamp in bytes, where it came from): the captured SGLANG_MORI_MAX_MR_BYTES, else 2 GiB."""
    if getattr(meta, "mori_max_mr_bytes", None) is not None:
        return meta.mori_max_mr_bytes, "SGLANG_MORI_MAX_MR_BYTES"
    return DEFAULT_MR_LIMIT, "default"


def band_of(region: int, item_bytes: int, page: int, tokens: Optional[int], clamp: int,
            transfer_backend: Optional[str] = None) -> tuple[str, int]:  # fmt: skip
    """(band, SGLang's clamp of max_total_num_tokens) of one buffer (the module docstring's table);
    ``unmeasured`` for a transfer backend the table has no figures for."""
    cap = clamp_tokens(clamp, item_bytes, page)
    tokens = region * page // item_bytes if tokens is None else tokens
    if not measured_for(transfer_backend):
        return "unmeasured", cap
    if region >= SMALLEST_FAILED:
        return "fails", cap
    if region > LARGEST_REGISTERED:
        return "unmeasured", cap
    return ("under_clamp" if tokens <= cap else "registers"), cap


def verdict_text(b: BufferBand, clamp: int, clamp_source: str, transfer_backend: Optional[str] = None) -> str:
    """The one sentence of a buffer's band, with its numbers: compared only with figures measured
    for ``transfer_backend`` (none for a backend the table does not hold)."""
    src = "SGLANG_MORI_MAX_MR_BYTES" if clamp_source != "default" else "the default"
    clamp_txt = f"SGLang's clamp {size_text(clamp, b.region_bytes)} ({src})"
    to = f"SGLang clamps max_total_num_tokens to {b.clamp_tokens}"
    size = size_text(b.region_bytes, clamp)
    if not measured_for(transfer_backend):
        return (f"{size}: nothing is measured for {transfer_backend} (the region sizes measured to register or fail "
                f"are MORI's), so it is unmeasured; under MORI, SGLang's clamp would take max_total_num_tokens to "
                f"{b.clamp_tokens} ({clamp_txt})")  # fmt: skip
    if b.band == "fails":
        return (f"{size} is at or past the smallest region measured to fail MORI registration "
                f"({SMALLEST_FAILED} bytes): over the MR limit, the KV of this buffer never arrives; {to} ({clamp_txt})")
    if b.band == "unmeasured":
        return (f"{size} is above the largest region measured to register ({LARGEST_REGISTERED} bytes) and below "
                f"the smallest measured to fail ({SMALLEST_FAILED} bytes): unmeasured, it may not register; {to} ({clamp_txt})")
    if b.band == "registers":
        return (f"{size} registers above SGLang's clamp: at most the largest region measured to register "
                f"({LARGEST_REGISTERED} bytes); {to} ({clamp_txt})")
    return f"{size} is under {clamp_txt}: it registers; SGLang keeps max_total_num_tokens <= {b.clamp_tokens}"


def decide(buffers: list[BufferBand], clamp: int, clamp_source: str, what: str, **numbers: Any) -> RegionCheck:
    """The check of a pool's buffers: the largest decides (the first of the largest)."""
    i = max(range(len(buffers)), key=lambda j: buffers[j].region_bytes)
    b = buffers[i]
    head = f"largest registered KV region: {what}, {b.bytes_per_token:g} bytes per token"
    said = verdict_text(b, clamp, clamp_source, numbers.get("transfer_backend"))
    return RegionCheck(BAND_STATUS[b.band], f"{head}: {said}", limit_bytes=clamp,
                       limit_source=clamp_source, region_bytes=b.region_bytes, fits_max_total_num_tokens=b.clamp_tokens,
                       bytes_per_token=b.bytes_per_token, band=b.band, buffers=buffers,
                       regions=sum(x.count for x in buffers), region_index=i if numbers.get("source") != "model" else None,
                       **numbers)  # fmt: skip


def _check_registered(meta: Any, base: dict) -> RegionCheck:
    """Every buffer the pool registers (its own get_contiguous_buf_infos())."""
    lens, items = meta.kv_pool_region_bytes, meta.kv_pool_region_item_bytes
    page = meta.kv_pool_page_size or meta.page_size
    clamp = base["limit_bytes"]
    bufs = []
    for j, (n, item) in enumerate(zip(lens, items)):
        band, cap = band_of(n, item, page, meta.kv_pool_size, clamp, base["transfer_backend"])
        bufs.append(BufferBand(f"buffer {j}", n, item, page, band, meta.kv_pool_size, cap))
    i = max(range(len(lens)), key=lambda j: lens[j])
    cls = f" of {meta.kv_pool_class}" if meta.kv_pool_class else ""
    what = f"buffer {i} of {len(lens)}{cls} ({items[i]} bytes per page of {page})"
    numbers = dict(row_bytes=items[i], page_size=page, source="get_contiguous_buf_infos", pool_class=meta.kv_pool_class,
                   max_total_num_tokens=meta.kv_pool_size, transfer_backend=base["transfer_backend"])  # fmt: skip
    return decide(bufs, clamp, base["limit_source"], what, **numbers)


def transfer_backend_of(meta: CaptureMeta) -> Optional[str]:
    """The transfer backend a capture's pool was registered with: the recorded one on a
    disaggregated node; None (judged by MORI's figures) where the server ran without disaggregation
    (SGLang names a default backend, mooncake, even then: nothing was registered with it)."""
    mode = getattr(meta, "disagg_mode", None)
    return meta.disagg_transfer_backend if mode not in (None, "null") else None


def check_region(meta: CaptureMeta) -> RegionCheck:
    """The region-size check of one capture's meta (see the module docstring)."""
    limit, source = mr_limit(meta)
    transfer = transfer_backend_of(meta)
    rows, row_bytes, lpb = meta.kv_pool_rows, meta.kv_pool_row_bytes, meta.kv_pool_layers_per_buffer
    base: dict[str, Any] = dict(limit_bytes=limit, limit_source=source, page_size=meta.page_size,
                                max_total_num_tokens=meta.kv_pool_size,
                                transfer_backend=transfer)  # fmt: skip
    if meta.kv_pool_region_bytes:
        return _check_registered(meta, base)
    if rows is None or row_bytes is None:
        missing = [k for k, v in (("kv_pool_rows", rows), ("kv_pool_row_bytes", row_bytes)) if v is None]
        return RegionCheck("not_recorded", f"pool geometry not recorded ({', '.join(missing)} missing in meta): "
                           "the region size was not checked", **base)  # fmt: skip
    lpb = lpb or 1
    page = meta.page_size
    region, item = rows * row_bytes * lpb, row_bytes * lpb * page
    tokens = meta.kv_pool_size if meta.kv_pool_size is not None else max(0, rows - page)
    band, cap = band_of(region, item, page, tokens, limit, transfer)
    buf = BufferBand("kv_buffer", region, item, page, band, tokens, cap)
    what = f"{rows} rows x {row_bytes} bytes x {lpb} layer(s)"
    return decide([buf], limit, source, what, rows=rows, row_bytes=row_bytes, layers_per_buffer=lpb, page_size=page,
                  max_total_num_tokens=meta.kv_pool_size, transfer_backend=transfer)  # fmt: skip


@dataclass(frozen=True)
class PlannedBuffer:
    """A kind of buffer a model's pool registers: ``count`` alike (one per layer), ``item_bytes`` per page."""

    name: str  # "C4 KV", "MLA KV", ...
    item_bytes: int  # bytes of one page of page_size tokens
    page_size: int
    count: int = 1


def plan_regions(buffers: list[PlannedBuffer], tokens: int, clamp: Optional[int] = None,
                 transfer_backend: str = "mori", what: str = "") -> RegionCheck:
    """The check before a server starts: a pool of ``tokens`` (max_total_num_tokens) with these
    buffers, each ``tokens x bytes_per_token`` (the module docstring), against ``clamp`` (None: 2 GiB)."""
    limit, source = (DEFAULT_MR_LIMIT, "default") if clamp is None else (clamp, "SGLANG_MORI_MAX_MR_BYTES")
    bands = []
    for p in buffers:
        region = tokens * p.item_bytes // p.page_size
        band, cap = band_of(region, p.item_bytes, p.page_size, tokens, limit, transfer_backend)
        bands.append(BufferBand(p.name, region, p.item_bytes, p.page_size, band, tokens, cap, p.count))
    i = max(range(len(bands)), key=lambda j: bands[j].region_bytes)
    label = f"{what + ' ' if what else ''}{bands[i].name} buffer ({bands[i].count} alike)"
    return decide(bands, limit, source, label, source="model", page_size=bands[i].page_size, max_total_num_tokens=tokens,
                  transfer_backend=transfer_backend, row_bytes=bands[i].item_bytes)  # fmt: skip


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
