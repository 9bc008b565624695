"""Reading and writing KV writer captures (refmla.capture.kinds: lazily mapped, validated, atomic)."""

from __future__ import annotations

from refmla.capture.kinds import Kind
from refmla.kvwrite.format import TENSORS, KvWriteCapture, parse_kv_write_meta

KV_WRITE = Kind(TENSORS, parse_kv_write_meta, KvWriteCapture)
read_kv_write = KV_WRITE.read  # path -> KvWriteCapture; CaptureError names the file and the tensor or key
write_kv_write = KV_WRITE.write  # (path, tensors, meta) -> path, validated first, atomic

__all__ = ["KV_WRITE", "read_kv_write", "write_kv_write"]
