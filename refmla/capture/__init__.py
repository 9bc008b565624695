"""The capture file, format ``refmla.capture/1`` (docs/contract.md section 1).

One ``.safetensors`` file holds one attention call of one layer on one rank. ``read_capture``
validates everything a replay relies on and raises :class:`CaptureError` naming the file and
the tensor or key; ``write_capture`` compacts the pool to the rows actually referenced and
writes atomically (temp file + rename).

    dcp.py         decode context parallelism's shard geometry: which rank holds which position
    numbers.py     every numeric meta key of every capture kind: its type and range, one table
    format.py      what the file holds: TENSORS, the meta keys and their bounds, Capture
    rows.py        what each attended row holds (token ids) and where it came from (prefix cache, host tier, L3)
    validation.py  the structural checks, a list of small functions run in order
    read.py        read_capture: header, lazily mapped tensors, validation
    write.py       compact_pool and write_capture (atomic, header sorted)
    kinds.py       the kinds with tensors of their own (kv_write, merge): read / write by their spec
"""

from refmla.capture.format import (
    CAPTURE_FORMAT,
    FLOAT_DTYPES,
    GEOMETRY_KEYS,
    INDEX_DTYPES,
    META_CHECKS,
    META_KEYS,
    TENSORS,
    Capture,
    CaptureError,
    CaptureMeta,
    check_meta_numbers,
    parse_meta,
)
from refmla.capture.read import check_file, read_capture
from refmla.capture.validation import CHECKS, validate
from refmla.capture.write import compact_pool, write_capture

__all__ = [
    "GEOMETRY_KEYS",
    "CAPTURE_FORMAT",
    "CHECKS",
    "FLOAT_DTYPES",
    "INDEX_DTYPES",
    "META_CHECKS",
    "META_KEYS",
    "TENSORS",
    "Capture",
    "CaptureError",
    "CaptureMeta",
    "check_file",
    "check_meta_numbers",
    "compact_pool",
    "parse_meta",
    "read_capture",
    "validate",
    "write_capture",
]
