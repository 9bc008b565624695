"""Reading and writing merge captures (refmla.capture.kinds: lazily mapped, validated, atomic)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import torch

from refmla.capture.kinds import read_kind, write_kind
from refmla.merge.format import TENSORS, MergeCapture, parse_merge_meta


def read_merge(path: Any) -> MergeCapture:
    """Open, validate and load; CaptureError names the file and the tensor or key."""
    cap, warnings = read_kind(path, TENSORS, parse_merge_meta, MergeCapture)
    cap.warnings.extend(warnings)
    return cap


def write_merge(path: Any, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> Path:
    """Validate, then write atomically."""
    parsed = parse_merge_meta(dict(meta), path)
    return write_kind(path, tensors, parsed.to_json(), TENSORS, lambda p, t: MergeCapture(path=str(p), meta=parsed, **t))


__all__ = ["read_merge", "write_merge"]
