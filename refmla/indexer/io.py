"""Reading and writing indexer captures (refmla.capture.kinds: lazily mapped, validated, atomic)."""

from __future__ import annotations

from refmla.capture.kinds import Kind
from refmla.indexer.format import TENSORS, IndexerCapture, parse_indexer_meta

INDEXER = Kind(TENSORS, parse_indexer_meta, IndexerCapture)
read_indexer = INDEXER.read  # path -> IndexerCapture; CaptureError names the file and the tensor or key
write_indexer = INDEXER.write  # (path, tensors, meta) -> path, validated first, atomic

__all__ = ["INDEXER", "read_indexer", "write_indexer"]
