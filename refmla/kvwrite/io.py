"""Reading and writing KV writer captures (refmla.capture.kinds: lazily mapped, validated, atomic)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import torch

from refmla.capture.kinds import read_kind, write_kind
from refmla.kvwrite.format import TENSORS, KvWriteCapture, parse_kv_write_meta


def read_kv_write(path: Any) -> KvWriteCapture:
    """Open, validate and load; CaptureError names the file and the tensor or key."""
    cap, warnings = read_kind(path, TENSORS, parse_kv_write_meta, KvWriteCapture)
    cap.warnings.extend(warnings)
    return cap


def write_kv_write(path: Any, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> Path:
    """Validate, then write atomically (the file appears under its name only once complete)."""
    parsed = parse_kv_write_meta(dict(meta), path)
    return write_kind(path, tensors, parsed.to_json(), TENSORS,
                      lambda p, t: KvWriteCapture(path=str(p), meta=parsed, **t))  # fmt: skip


__all__ = ["read_kv_write", "write_kv_write"]
