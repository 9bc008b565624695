"""Capture kinds: what differs between the captures the one replay (refmla.pipeline) takes, behind
one small interface (:class:`refmla.kinds.base.Kind`): the report's head and metadata checks, the
reference and the control for a declared arithmetic, the backends by name, the rows compared, the
localization, the hypothesis families, the diagnosis.

Modules, imports going down this list:

    base.py    Kind (the hooks) and Judged (one backend's result judged at its own arithmetic)
    dense.py   token-slot and block-table captures (decode, extend, verify): refmla.context, refmla.backends
    sparse.py  sparse decode captures (DeepSeek V3.2 / V4): refmla.sparse, its kernels as Backends

:func:`read` reads either kind's file; :func:`kind_of` gives a capture's kind.
"""

from __future__ import annotations

from typing import Any, Optional

from refmla.capture import read_capture
from refmla.kinds.base import Judged, Kind
from refmla.kinds.dense import DenseKind, backend_names, engine_default
from refmla.kinds.sparse import SparseKind
from refmla.options import ReplayOptions
from refmla.sparse.backends import SPARSE_ONLY
from refmla.sparse.format import SPARSE_MODE, SparseCapture
from refmla.sparse.validation import is_sparse_file, read_sparse


def file_kind(path: Any) -> Optional[str]:
    """The report ``kind`` of a capture file that could not be read: ``sparse_decode`` or None."""
    return SPARSE_MODE if is_sparse_file(path) else None


def read(path: Any):
    """A sparse decode capture or a dense one (refmla.capture); CaptureError for bad input."""
    return read_sparse(path) if is_sparse_file(path) else read_capture(path)


def kind_of(cap: Any, opts: ReplayOptions) -> Kind:
    return SparseKind(cap, opts) if isinstance(cap, SparseCapture) else DenseKind(cap, opts)


__all__ = ["DenseKind", "Judged", "Kind", "SPARSE_ONLY", "SparseKind", "backend_names", "engine_default", "file_kind",
           "kind_of", "read"]  # fmt: skip
