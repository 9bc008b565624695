"""The capture kinds with tensors of their own (meta ``mode`` ``kv_write``, ``merge``): the same
``refmla.capture/1`` container, read lazily and validated, written validated and atomically.

Each kind states its tensors (name -> required), a meta parser and a validator; these two
functions do the rest for all of them (refmla.kvwrite.io, refmla.merge.io).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from refmla import CAPTURE_FORMAT
from refmla.atomic import write_bytes
from refmla.capture.format import CaptureError
from refmla.capture.read import open_capture
from refmla.capture.write import sorted_header


def file_mode(path: Any) -> str:
    """The meta ``mode`` of a capture file from its header alone ("" when it has none, the file
    cannot be read, or it is no regular file): to choose the reader before reading."""
    from safetensors import safe_open

    try:
        if not Path(path).is_file():
            return ""
        with safe_open(str(path), framework="pt", device="cpu") as f:
            meta = json.loads((f.metadata() or {}).get("meta", "{}"))
        return str(meta.get("mode", "")) if isinstance(meta, dict) else ""
    except Exception:
        return ""


def header_meta(path: Path, header: dict) -> dict:
    """The ``meta`` JSON object of a header, after the format tag; CaptureError naming the key."""
    if header.get("format") != CAPTURE_FORMAT:
        raise CaptureError(path, "header key 'format'", f"expected {CAPTURE_FORMAT!r}, got {header.get('format')!r}")
    try:
        meta = json.loads(header.get("meta", "null"))
    except (json.JSONDecodeError, RecursionError):
        raise CaptureError(path, "header key 'meta'", "not valid JSON") from None
    if not isinstance(meta, dict):
        raise CaptureError(path, "header key 'meta'", "missing or not a JSON object")
    return meta


def read_kind(path: Any, spec: Mapping[str, bool], parse: Callable[[dict, Path], Any],
              build: Callable[..., Any]) -> tuple[Any, list[str]]:  # fmt: skip
    """(the kind's capture, warnings): the file opened, the meta parsed by ``parse``, the tensors of
    ``spec`` mapped, ``build(path=, meta=, **tensors)`` (which validates). CaptureError names the file."""
    path = Path(path)
    meta, loaded, names = open_capture(path, dict(spec), lambda p, h: parse(header_meta(p, h), p))
    cap = build(path=str(path), meta=meta, **loaded)
    unknown = sorted(names - set(spec))
    return cap, ([f"tensors not in this capture kind, ignored: {', '.join(unknown)}"] if unknown else [])


def write_kind(path: Any, tensors: Mapping[str, torch.Tensor], meta_json: dict, spec: Mapping[str, bool],
               check: Callable[[Path, dict], None]) -> Path:  # fmt: skip
    """Validate (``check(path, tensors)`` raises CaptureError), then write atomically."""
    from safetensors.torch import save

    path = Path(path)
    unknown = sorted(set(tensors) - set(spec))
    if unknown:
        raise CaptureError(path, f"tensor '{unknown[0]}'", "not part of this capture kind")
    t = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items() if v is not None}
    check(path, t)
    header = {"format": CAPTURE_FORMAT, "meta": json.dumps(meta_json, sort_keys=True)}
    write_bytes(path, sorted_header(save(t, metadata=header)), make_parents=True)
    return path


__all__ = ["file_mode", "header_meta", "read_kind", "write_kind"]
