"""Reading and writing merge captures (refmla.capture.kinds: lazily mapped, validated, atomic)."""

from __future__ import annotations

from refmla.capture.kinds import Kind
from refmla.merge.format import TENSORS, MergeCapture, parse_merge_meta

MERGE = Kind(TENSORS, parse_merge_meta, MergeCapture)
read_merge = MERGE.read  # path -> MergeCapture; CaptureError names the file and the tensor or key
write_merge = MERGE.write  # (path, tensors, meta) -> path, validated first, atomic

__all__ = ["MERGE", "read_merge", "write_merge"]
