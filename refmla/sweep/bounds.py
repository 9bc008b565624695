"""The size bounds a sweep walks under, by where it runs: ``cpu`` (the Triton interpreter's cost),
``gpu`` (production sizes, within the device's memory) and ``production`` (production sizes
whatever the device holds). ``refmla sweep`` takes ``cpu`` under the Triton interpreter (no GPU)
and ``gpu`` on a GPU; ``--sizes`` picks a profile and ``--max-*`` flags override one bound.

    rows          query rows x heads of one case (the interpreter's stage 2 runs one program per
                  (row, head)); production decode: 16-128 heads x batches of 64-256
    tile_tokens   attended tokens x 16-head tiles of one case (stage 1's work)
    length        the longest context the length axes name (production: 8k-128k)
    batch         the largest batch the batch axes name
    sparse_units  16-head tiles x each query row's 128-entry blocks of a sparse case
    sparse_context  request 0's context of a sparse case
    pool_rows     the most pool rows one dense case may span: past INT32_BASE_ROW (2**31 elements
                  of 576, and 4096 rows more) the ``pool`` axis gains ``past-int32`` (a case whose
                  pool is moved to rows past int32 element offsets); 0 on the CPU

The report states the bounds it walked under (``SweepReport.bounds``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Optional

PROFILES_ORDER = ("cpu", "gpu", "production")
ROW_ALIGN = 256  # the largest page of the dense layouts: a moved pool starts on a page of every size
INT32_BASE_ROW = -(-(2**31 // 576 + 4096) // ROW_ALIGN) * ROW_ALIGN  # a moved pool's first row: its element offsets pass 2**31
KV_ROW_BYTES = 576 * 2  # one bf16 token row of the pool (kv_lora_rank 512 + rope 64)
MEMORY_SHARE = 0.25  # of the device's free memory one case's pool may take (the buffers, the reference's copies)


@dataclass(frozen=True)
class Bounds:
    profile: str  # cpu | gpu | production (and "+ overrides" where a --max-* flag changed one)
    rows: int
    tile_tokens: int
    length: int
    batch: int
    sparse_units: int
    sparse_context: int
    pool_rows: int = 0  # the most rows one dense case's pool may span (past INT32_BASE_ROW: the int32-offset class)
    largest_first: bool = False  # the walk takes its longest lengths and largest batches first

    @property
    def long(self) -> bool:
        """Past the interpreter's lengths: the long context values join the length axes."""
        return self.length > CPU.length

    def to_json(self) -> dict:
        return asdict(self)


CPU = Bounds("cpu", rows=256, tile_tokens=8192, length=4097, batch=64, sparse_units=64, sparse_context=16384)
PRODUCTION = Bounds("production", rows=256 * 128, tile_tokens=8 * 2**21, length=131073, batch=256,
                    sparse_units=8 * 256 * 17, sparse_context=131072 * 4, pool_rows=2 * INT32_BASE_ROW,
                    largest_first=True)  # fmt: skip


def device_bounds(free_bytes: Optional[int]) -> Bounds:
    """The ``gpu`` profile: production's, with request 0's context and a case's pool rows cut to
    what a quarter of the device's free memory holds (a pool of bf16 rows; None: production's)."""
    if free_bytes is None:
        return replace(PRODUCTION, profile="gpu")
    rows = int(free_bytes * MEMORY_SHARE) // KV_ROW_BYTES
    longest = max(CPU.length, min(PRODUCTION.length, rows))
    return replace(PRODUCTION, profile="gpu", length=longest, pool_rows=min(PRODUCTION.pool_rows, rows))


def free_device_memory() -> Optional[int]:
    """Free bytes of the current CUDA / ROCm device, or None where there is none."""
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        return int(torch.cuda.mem_get_info()[0])
    except Exception:
        return None


def where_it_runs() -> str:
    """``cpu`` under the Triton interpreter (or without a GPU), else ``gpu``."""
    from refmla.backends.triton_interp import gpu_present, interpreter_active

    return "cpu" if interpreter_active() or not gpu_present() else "gpu"


OVERRIDES = ("rows", "tile_tokens", "length", "batch", "sparse_units", "sparse_context", "pool_rows")


def bounds_for(sizes: Optional[str] = None, free_bytes: Optional[int] = None, **overrides: Optional[int]) -> Bounds:
    """The bounds of profile ``sizes`` (None: :func:`where_it_runs`), each of ``overrides``
    (``length=32769``, a name of OVERRIDES) replacing its bound. ValueError for an unknown profile
    or a bound that is not a positive integer."""
    sizes = sizes or where_it_runs()
    if sizes == "cpu":
        b = CPU
    elif sizes == "gpu":
        b = device_bounds(free_bytes if free_bytes is not None else free_device_memory())
    elif sizes == "production":
        b = PRODUCTION
    else:
        raise ValueError(f"--sizes: {sizes!r} is not one of {', '.join(PROFILES_ORDER)}")
    given = {k: v for k, v in overrides.items() if v is not None}
    for k, v in given.items():
        if k not in OVERRIDES:
            raise ValueError(f"unknown bound {k!r}; choose from {', '.join(OVERRIDES)}")
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"--max-{k.replace('_', '-')}: must be a positive integer, got {v!r}")
    return replace(b, profile=b.profile + (" + overrides" if given else ""), **given) if given else b


__all__ = ["CPU", "INT32_BASE_ROW", "OVERRIDES", "ROW_ALIGN", "PRODUCTION", "PROFILES_ORDER", "Bounds", "bounds_for", "device_bounds",
           "free_device_memory", "where_it_runs"]
