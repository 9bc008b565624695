"""Reading a capture: open, check the header, map the tensors lazily, validate.

Every failure is a :class:`CaptureError` naming the file and the tensor or key.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import stat
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch

from refmla import CAPTURE_FORMAT
from refmla import blocktable
from refmla.capture.format import BUILT_FROM_BLOCK_TABLE, MAX_META_DEPTH, TENSORS, Capture, CaptureError, CaptureMeta, parse_meta
from refmla.capture.numbers import meta_json
from refmla.capture.validation import validate
from refmla.util import first_line, printable


def read_capture(path: Any) -> Capture:
    """Open, validate and load a capture. Raises CaptureError (file + tensor/key + reason)."""
    path = Path(path)
    meta, loaded, names = open_capture(path, TENSORS, _read_meta, built_from_table=BUILT_FROM_BLOCK_TABLE)
    if "block_table" in names and not any(n in names for n in BUILT_FROM_BLOCK_TABLE):
        loaded.update(_token_rows(path, meta, loaded))
    cap = Capture(path=str(path), meta=meta, **loaded)
    cap.warnings.extend(validate(cap))
    cap.attended()  # built once, here, from the validated indices
    unknown = sorted(names - set(TENSORS))
    if unknown:
        cap.warnings.append(f"tensors not in refmla.capture/1, ignored: {', '.join(printable(n) for n in unknown)}")
    return cap


def open_capture(
    path: Path, spec: dict, read_meta: Callable[[Path, dict], Any], built_from_table: tuple[str, ...] = ()
) -> tuple[Any, dict, set]:
    """(meta, tensors, names in the file) of a capture file whose tensors ``spec`` names (name ->
    required): the file checked by stat, the header's meta parsed by ``read_meta``, the required
    tensors present, the known ones lazily mapped. Raises CaptureError naming the file.

    ``built_from_table``: required tensors a ``block_table`` stands in for when none of them is in
    the file (the caller builds them from the table)."""
    from safetensors import SafetensorError

    _check_file(path)
    try:
        with safetensors_open(path) as f:
            meta = read_meta(path, f.metadata() or {})
            names = set(f.keys())
            by_table = "block_table" in names and not any(n in names for n in built_from_table)
            for name, required in spec.items():
                if required and name not in names and not (by_table and name in built_from_table):
                    raise CaptureError(path, f"tensor '{name}'", "missing")
            return meta, _map_tensors(path, [n for n in spec if n in names], f), names
    except CaptureError:
        raise
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        reason = first_line(e) or type(e).__name__
        raise CaptureError(path, "file", f"not a readable safetensors file ({reason})") from None


@contextlib.contextmanager
def safetensors_open(path: Any) -> Iterator[Any]:
    """safetensors' ``safe_open`` (torch, CPU) for any file name: one that is not UTF-8 (a byte name
    Python holds with surrogateescape, which safetensors refuses) is opened here and handed over as
    /proc/self/fd/N."""
    from safetensors import safe_open

    name = os.fspath(path)
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK)  # a regular file (stat'ed by the caller): never blocks
        try:
            with safe_open(f"/proc/self/fd/{fd}", framework="pt", device="cpu") as f:
                yield f
        finally:
            os.close(fd)
        return
    with safe_open(name, framework="pt", device="cpu") as f:
        yield f


def _token_rows(path: Path, meta: CaptureMeta, t: dict) -> dict[str, torch.Tensor]:
    """kv_indptr / kv_indices built from the block table (docs/contract.md section 1, "block
    tables"); every inconsistency that would make the rows unreadable is one line of the error."""
    table, seq, pool = t["block_table"], t["seq_lens"], t["kv_buffer"]
    if table.dim() != 2 or seq.dim() != 1 or table.shape[0] != seq.shape[0] or pool.dim() != 3:
        raise CaptureError(path, "tensor 'block_table'", f"shape {list(table.shape)}, expected [B, max_blocks] "
                           f"with B = {seq.shape[0] if seq.dim() == 1 else '?'} (seq_lens) and kv_buffer [N, 1, D]")  # fmt: skip
    if table.dtype not in (torch.int32, torch.int64) or seq.dtype not in (torch.int32, torch.int64):
        raise CaptureError(path, "tensor 'block_table'", "block_table and seq_lens must be int32 / int64")
    if bool((seq < 0).any()):
        raise CaptureError(path, "tensor 'seq_lens'", "negative length")
    found = blocktable.problems(table, seq, meta.page_size, pool.shape[0])
    if found.errors:
        raise CaptureError(path, "tensor 'block_table'", found.text(found.errors))
    kv_indptr, kv_indices = blocktable.token_rows(table, seq, meta.page_size)
    return {"kv_indptr": kv_indptr, "kv_indices": kv_indices}


def check_file(path: Any) -> None:
    """A regular file, found by stat alone: a FIFO or a device is never opened (it could block);
    else CaptureError naming the file: ``no such file``, ``cannot stat (...)``, ``not a regular file``.
    Every reader's first question, so that all say the same (replay, inspect, disagg)."""
    _check_file(Path(path))


def _check_file(path: Path) -> None:
    """A regular file, found by stat alone: a FIFO or a device is never opened (it could block)."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise CaptureError(path, "file", "no such file") from None
    except OSError as e:
        raise CaptureError(path, "file", f"cannot stat ({e.strerror or type(e).__name__})") from None
    if not stat.S_ISREG(mode):
        raise CaptureError(path, "file", "not a regular file")


def _read_meta(path: Path, header: dict) -> CaptureMeta:
    """The safetensors ``__metadata__``: the format tag, then the ``meta`` JSON, parsed."""
    fmt = header.get("format")
    if fmt != CAPTURE_FORMAT:
        raise CaptureError(path, "header key 'format'", f"expected {CAPTURE_FORMAT!r}, got {fmt!r}")
    if "meta" not in header:
        raise CaptureError(path, "header key 'meta'", "missing")
    try:
        raw_meta = meta_json(header["meta"])
    except json.JSONDecodeError as e:
        raise CaptureError(path, "header key 'meta'", f"not valid JSON ({e.msg})") from None
    except RecursionError:  # too deep for the decoder: name the key from the text itself
        key = _deep_key(header["meta"])
        where = f"meta key '{key}'" if key is not None else "header key 'meta'"
        raise CaptureError(path, where, f"nested deeper than {MAX_META_DEPTH} levels") from None
    return parse_meta(raw_meta, path)


def _deep_key(text: str) -> Optional[str]:
    """The top-level key of a JSON object text whose value nests past MAX_META_DEPTH (a scan, no
    recursion), or None."""
    depth, key, i, last = 0, None, 0, None
    while i < len(text):
        c = text[i]
        if c == '"':
            j = i + 1
            while j < len(text) and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            last, i = text[i + 1 : j], j
        elif c == ":" and depth == 1:
            key = last
        elif c in "[{":
            depth += 1
            if depth > MAX_META_DEPTH + 1:
                return key
        elif c in "]}":
            depth -= 1
        i += 1
    return None


_ST_DTYPES = {
    "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
    "I32": torch.int32, "I64": torch.int64, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "F8_E4M3FNUZ": torch.float8_e4m3fnuz, "F8_E5M2FNUZ": torch.float8_e5m2fnuz,
}  # fmt: skip


def _map_tensors(path: Path, names: list[str], f) -> dict[str, torch.Tensor]:
    """Tensors backed by a private (copy-on-write) memory map of the file: nothing is read until
    touched, so a replay pulls in only the pool rows it attends and never holds the pool twice.
    ``f`` (an open safe_open, which has validated the header) serves any dtype not mapped here."""
    import mmap
    import struct

    with open(path, "rb") as fh:
        n = struct.unpack("<Q", fh.read(8))[0]
        header = json.loads(fh.read(n))
        mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)
    out = {}
    for name in names:
        info = header[name]
        dtype, shape = _ST_DTYPES.get(info["dtype"]), info["shape"]
        start, end = info["data_offsets"]
        if dtype is None or math.prod(shape) == 0:
            out[name] = f.get_tensor(name)
            continue
        count = (end - start) // dtype.itemsize
        out[name] = torch.frombuffer(mm, dtype=dtype, count=count, offset=8 + n + start).reshape(shape)
    return out


__all__ = ["open_capture", "read_capture", "safetensors_open"]
