"""Reading and writing merge and chunked-prefill captures (refmla.capture.kinds: lazily mapped,
validated, atomic)."""

from __future__ import annotations

from refmla.capture.kinds import Kind
from refmla.merge import chunked_format
from refmla.merge.format import TENSORS, MergeCapture, parse_merge_meta

MERGE = Kind(TENSORS, parse_merge_meta, MergeCapture)
read_merge = MERGE.read  # path -> MergeCapture; CaptureError names the file and the tensor or key
write_merge = MERGE.write  # (path, tensors, meta) -> path, validated first, atomic

CHUNKED = Kind(chunked_format.TENSORS, chunked_format.parse_chunked_meta, chunked_format.ChunkedCapture)
read_chunked = CHUNKED.read  # path -> ChunkedCapture
write_chunked = CHUNKED.write

__all__ = ["CHUNKED", "MERGE", "read_chunked", "read_merge", "write_chunked", "write_merge"]
