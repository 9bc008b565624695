"""Reading and writing sparse decode captures: validated before writing, written atomically,
read lazily (the same container and helpers as every capture, refmla.capture)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

import torch

from refmla import CAPTURE_FORMAT
from refmla.atomic import write_bytes
from refmla.capture import CaptureError
from refmla.capture.numbers import meta_json
from refmla.capture.read import open_capture, safetensors_open
from refmla.capture.write import sorted_header
from refmla.sparse.format import TENSORS, SparseCapture, SparseMeta, is_sparse_meta, parse_sparse_meta
from refmla.sparse.validation import validate


def file_meta(path: Any) -> dict:
    """The raw ``meta`` JSON of a capture file ({} when it has none or cannot be read): to tell a
    sparse capture from a dense one before choosing the reader."""
    try:
        with safetensors_open(path) as f:
            return meta_json((f.metadata() or {}).get("meta", "{}"))
    except Exception:
        return {}


def is_sparse_file(path: Any) -> bool:
    """A regular file whose meta says sparse decode; any path the OS refuses (a name too long, no
    permission) is not, and the dense reader names the file and the reason."""
    try:
        return Path(path).is_file() and is_sparse_meta(file_meta(path))
    except (OSError, ValueError):
        return False


def _sparse_meta(path: Path, header: dict) -> SparseMeta:
    if header.get("format") != CAPTURE_FORMAT:
        raise CaptureError(path, "header key 'format'", f"expected {CAPTURE_FORMAT!r}, got {header.get('format')!r}")
    try:
        return parse_sparse_meta(meta_json(header.get("meta", "null")), path)
    except (json.JSONDecodeError, TypeError, AttributeError):
        raise CaptureError(path, "header key 'meta'", "missing or not a JSON object") from None


def read_sparse(path: Any) -> SparseCapture:
    """Open, validate and load a sparse capture. Raises CaptureError (file + tensor/key + reason)."""
    path = Path(path)
    meta, loaded, names = open_capture(path, TENSORS, _sparse_meta)
    cap = SparseCapture(path=str(path), meta=meta, **loaded)
    validate(cap)
    unknown = sorted(names - set(TENSORS))
    if unknown:
        cap.warnings.append(f"tensors not in the sparse capture format, ignored: {', '.join(unknown)}")
    return cap


def write_sparse(path: Any, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> Path:
    """Validate, then write atomically (the file appears under its name only once complete)."""
    from safetensors.torch import save

    path = Path(path)
    unknown = set(tensors) - set(TENSORS)
    if unknown:
        raise CaptureError(path, f"tensor '{sorted(unknown)[0]}'", "not part of the sparse capture format")
    t = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items() if v is not None}
    parsed = parse_sparse_meta(dict(meta), path)
    validate(SparseCapture(path=str(path), meta=parsed, **t))
    header = {"format": CAPTURE_FORMAT, "meta": json.dumps(parsed.to_json(), sort_keys=True)}
    write_bytes(path, sorted_header(save(t, metadata=header)), make_parents=True)
    return path


__all__ = ["file_meta", "is_sparse_file", "read_sparse", "write_sparse"]
