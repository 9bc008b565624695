"""The capture file, format ``refmla.capture/1`` (CONTRACT section 1).

One ``.safetensors`` file holds one attention call of one layer on one rank. ``read_capture``
validates everything a replay relies on and raises :class:`CaptureError` naming the file and
the tensor or key; ``write_capture`` compacts the pool to the rows actually referenced and
writes atomically (temp file + rename).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping, Optional

import torch

from refmla import CAPTURE_FORMAT
from refmla.util import dtype_name, first_line, request_label

FLOAT_DTYPES = {
    torch.bfloat16, torch.float16, torch.float32, torch.float64,
    torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2, torch.float8_e5m2fnuz,
}  # fmt: skip
INDEX_DTYPES = {torch.int32, torch.int64}

# name -> required; shapes and dtypes are checked in _check_tensors
TENSORS = {
    "q": True, "kv_buffer": True, "kv_indptr": True, "kv_indices": True, "seq_lens": True,
    "num_kv_splits": False, "out": False, "lse": False, "attn_logits": False, "attn_lse": False,
    "req_to_token": False, "orig_kv_indices": False, "qo_indptr": False,
}  # fmt: skip


class CaptureError(Exception):
    """Invalid or unusable input: names the file and the tensor or key."""

    def __init__(self, path: Any, key: str, message: str):
        self.path, self.key, self.message = str(path), key, message
        super().__init__(f"{self.path}: {key}: {message}")


@dataclass
class CaptureMeta:
    mode: str  # "decode" (one query token per request) or "extend"
    backend: str  # production backend that produced `out`: triton | aiter | unknown
    kv_lora_rank: int  # Dv, latent (value) width
    qk_rope_head_dim: int  # rope width; D = kv_lora_rank + qk_rope_head_dim
    sm_scale: float  # softmax scale exactly as passed to the kernel
    logit_cap: float  # tanh soft cap, 0 = off
    page_size: int  # production pool page size (indices are token level)
    k_scale: float = 1.0
    v_scale: float = 1.0
    max_kv_splits: Optional[int] = None
    layer_id: Optional[int] = None
    tp_rank: Optional[int] = None
    step: Optional[int] = None
    rids: Optional[list] = None
    sglang_version: Optional[str] = None
    aiter_version: Optional[str] = None
    extra: dict = field(default_factory=dict)  # keys this version does not know, kept as given

    @property
    def head_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    def to_json(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "extra"}
        d = {k: v for k, v in d.items() if v is not None}
        return {**self.extra, **d}


# key -> (type, required); int keys accept integral floats, float keys accept ints
_META_KEYS = {
    "mode": (str, True), "backend": (str, True), "kv_lora_rank": (int, True),
    "qk_rope_head_dim": (int, True), "sm_scale": (float, True), "logit_cap": (float, True),
    "page_size": (int, True), "k_scale": (float, False), "v_scale": (float, False),
    "max_kv_splits": (int, False), "layer_id": (int, False), "tp_rank": (int, False),
    "step": (int, False), "rids": (list, False), "sglang_version": (str, False),
    "aiter_version": (str, False),
}  # fmt: skip


def parse_meta(raw: Mapping[str, Any], path: Any = "<meta>") -> CaptureMeta:
    """Validate the ``meta`` JSON object and build a CaptureMeta."""
    if not isinstance(raw, Mapping):
        raise CaptureError(path, "meta", "must be a JSON object")
    kw: dict[str, Any] = {}
    for key, (typ, required) in _META_KEYS.items():
        if key not in raw or raw[key] is None:
            if required:
                raise CaptureError(path, f"meta key '{key}'", "missing")
            continue
        kw[key] = _coerce(raw[key], typ, path, key)
    if kw["mode"] not in ("decode", "extend"):
        raise CaptureError(path, "meta key 'mode'", f"must be 'decode' or 'extend', got {kw['mode']!r}")
    for key in ("kv_lora_rank", "page_size"):
        if kw[key] < 1:
            raise CaptureError(path, f"meta key '{key}'", f"must be >= 1, got {kw[key]}")
    if kw["qk_rope_head_dim"] < 0:
        raise CaptureError(path, "meta key 'qk_rope_head_dim'", f"must be >= 0, got {kw['qk_rope_head_dim']}")
    for key in ("sm_scale", "k_scale", "v_scale"):
        if key in kw and not (math.isfinite(kw[key]) and kw[key] > 0):
            raise CaptureError(path, f"meta key '{key}'", f"must be finite and > 0, got {kw[key]}")
    if not (math.isfinite(kw["logit_cap"]) and kw["logit_cap"] >= 0):
        raise CaptureError(path, "meta key 'logit_cap'", f"must be finite and >= 0, got {kw['logit_cap']}")
    if kw.get("max_kv_splits") is not None and kw["max_kv_splits"] < 1:
        raise CaptureError(path, "meta key 'max_kv_splits'", f"must be >= 1, got {kw['max_kv_splits']}")
    if "rids" in kw:
        kw["rids"] = [str(r) for r in kw["rids"]]
    extra = {k: v for k, v in raw.items() if k not in _META_KEYS and k != "format"}
    return CaptureMeta(**kw, extra=extra)


def _coerce(value: Any, typ: type, path: Any, key: str) -> Any:
    bad = CaptureError(path, f"meta key '{key}'", f"must be {typ.__name__}, got {value!r}")
    if isinstance(value, bool):
        raise bad
    if typ is int:
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if not isinstance(value, int):
            raise bad
    elif typ is float:
        if not isinstance(value, (int, float)):
            raise bad
        return float(value)
    elif not isinstance(value, typ):
        raise bad
    return value


@dataclass
class Capture:
    """One captured attention call. Tensors keep the dtypes they were stored with."""

    path: str
    meta: CaptureMeta
    q: torch.Tensor  # [B, H, D] decode, [T, H, D] extend
    kv_buffer: torch.Tensor  # [N, 1, D]
    kv_indptr: torch.Tensor  # [B + 1]
    kv_indices: torch.Tensor  # [kv_indptr[-1]]
    seq_lens: torch.Tensor  # [B]
    num_kv_splits: Optional[torch.Tensor] = None  # [B]
    out: Optional[torch.Tensor] = None  # [B, H, Dv] / [T, H, Dv], the production output
    lse: Optional[torch.Tensor] = None  # [B, H] / [T, H]
    attn_logits: Optional[torch.Tensor] = None  # [B, H, S, Dv]
    attn_lse: Optional[torch.Tensor] = None  # [B, H, S]
    req_to_token: Optional[torch.Tensor] = None  # [B, M]
    orig_kv_indices: Optional[torch.Tensor] = None  # like kv_indices
    qo_indptr: Optional[torch.Tensor] = None  # [B + 1], extend only
    warnings: list = field(default_factory=list)

    @property
    def batch_size(self) -> int:
        return self.kv_indptr.shape[0] - 1

    @property
    def num_heads(self) -> int:
        return self.q.shape[1]

    @property
    def is_decode(self) -> bool:
        return self.meta.mode == "decode"

    def tensors(self) -> dict[str, torch.Tensor]:
        return {n: getattr(self, n) for n in TENSORS if getattr(self, n) is not None}

    def scales(self) -> dict[str, Any]:
        """The keyword arguments every reference function takes."""
        m = self.meta
        return dict(kv_lora_rank=m.kv_lora_rank, sm_scale=m.sm_scale, logit_cap=m.logit_cap,
                    k_scale=m.k_scale, v_scale=m.v_scale)  # fmt: skip

    @property
    def out_dtype(self) -> torch.dtype:
        """The dtype a kernel writes this call's output in: the captured ``out``'s when it has one
        (bf16, fp16 or fp32), else q's, else bf16 (an fp8 q)."""
        for t in (self.out, self.q):
            if t is not None and t.dtype.is_floating_point and t.dtype.itemsize in (2, 4):
                return t.dtype
        return torch.bfloat16

    def rid(self, b: Optional[int]) -> Optional[str]:
        """Request b's id from meta ``rids``, or None."""
        rids = self.meta.rids
        return rids[b] if b is not None and rids is not None and 0 <= b < len(rids) else None

    def label(self, b: int) -> str:
        """"request b (rid ...)" for messages."""
        return request_label(b, self.rid(b))

    def request_of_row(self) -> torch.Tensor:
        """Request index of each row of `out` (decode: arange(B); extend: from qo_indptr)."""
        if self.is_decode:
            return torch.arange(self.batch_size)
        lens = (self.qo_indptr[1:] - self.qo_indptr[:-1]).long()
        return torch.repeat_interleave(torch.arange(self.batch_size), lens)


# --------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------


def read_capture(path: Any) -> Capture:
    """Open, validate and load a capture. Raises CaptureError (file + tensor/key + reason)."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    if not path.exists():
        raise CaptureError(path, "file", "no such file")
    if not path.is_file():
        raise CaptureError(path, "file", "not a regular file")
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            header = f.metadata() or {}
            fmt = header.get("format")
            if fmt != CAPTURE_FORMAT:
                raise CaptureError(path, "header key 'format'", f"expected {CAPTURE_FORMAT!r}, got {fmt!r}")
            if "meta" not in header:
                raise CaptureError(path, "header key 'meta'", "missing")
            try:
                raw_meta = json.loads(header["meta"])
            except json.JSONDecodeError as e:
                raise CaptureError(path, "header key 'meta'", f"not valid JSON ({e.msg})") from None
            meta = parse_meta(raw_meta, path)
            names = set(f.keys())
            for name, required in TENSORS.items():
                if required and name not in names:
                    raise CaptureError(path, f"tensor '{name}'", "missing")
            loaded = _map_tensors(path, [n for n in TENSORS if n in names], f)
    except CaptureError:
        raise
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        reason = first_line(e) or type(e).__name__
        raise CaptureError(path, "file", f"not a readable safetensors file ({reason})") from None
    cap = Capture(path=str(path), meta=meta, **loaded)
    cap.warnings.extend(validate(cap))
    unknown = sorted(names - set(TENSORS))
    if unknown:
        cap.warnings.append(f"tensors not in refmla.capture/1, ignored: {', '.join(unknown)}")
    return cap


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


def validate(cap: Capture) -> list[str]:
    """Structural checks a replay depends on. Raises CaptureError; returns warnings."""
    p, m = cap.path, cap.meta
    warnings: list[str] = []

    def err(name: str, msg: str) -> CaptureError:
        return CaptureError(p, f"tensor '{name}'", msg)

    def shape(name: str, t: torch.Tensor, want: tuple) -> None:
        if t.dim() != len(want) or any(w is not None and s != w for s, w in zip(t.shape, want)):
            pretty = "[" + ", ".join("?" if w is None else str(w) for w in want) + "]"
            raise err(name, f"shape {list(t.shape)}, expected {pretty}")

    def dtype(name: str, t: torch.Tensor, allowed: set) -> None:
        if t.dtype not in allowed:
            raise err(name, f"dtype {dtype_name(t.dtype)} not allowed here")

    D, Dv = m.head_dim, m.kv_lora_rank
    for name in ("kv_indptr", "kv_indices", "seq_lens", "num_kv_splits", "req_to_token",
                 "orig_kv_indices", "qo_indptr"):  # fmt: skip
        t = getattr(cap, name)
        if t is not None:
            dtype(name, t, INDEX_DTYPES)
    for name in ("q", "kv_buffer", "out", "lse", "attn_logits", "attn_lse"):
        t = getattr(cap, name)
        if t is not None:
            dtype(name, t, FLOAT_DTYPES)

    shape("kv_indptr", cap.kv_indptr, (None,))
    B = cap.kv_indptr.shape[0] - 1
    if B < 0:
        raise err("kv_indptr", "empty; expected [B + 1] entries")
    shape("q", cap.q, (None, None, D))
    T, H = cap.q.shape[0], cap.q.shape[1]
    if cap.is_decode and T != B:
        raise err("q", f"has {T} requests but kv_indptr describes {B}")
    shape("kv_buffer", cap.kv_buffer, (None, 1, D))
    N = cap.kv_buffer.shape[0]
    shape("seq_lens", cap.seq_lens, (B,))
    shape("kv_indices", cap.kv_indices, (None,))

    indptr = cap.kv_indptr.long()
    if B > 0 and bool((indptr[1:] < indptr[:-1]).any()):
        b = int(torch.nonzero(indptr[1:] < indptr[:-1])[0])
        raise err("kv_indptr", f"not monotone: kv_indptr[{b + 1}]={int(indptr[b + 1])} < kv_indptr[{b}]={int(indptr[b])}")
    if int(indptr[0]) < 0:
        raise err("kv_indptr", f"kv_indptr[0]={int(indptr[0])} is negative")
    if int(indptr[0]) != 0:
        warnings.append(f"kv_indptr[0]={int(indptr[0])}: the first {int(indptr[0])} kv_indices are unused")
    if int(indptr[-1]) != cap.kv_indices.shape[0]:
        raise err("kv_indices", f"length {cap.kv_indices.shape[0]} != kv_indptr[-1]={int(indptr[-1])}")
    seq = cap.seq_lens.long()
    if bool((seq < 0).any()):
        b = int(torch.nonzero(seq < 0)[0])
        raise err("seq_lens", f"negative length seq_lens[{b}]={int(seq[b])}")
    lens = indptr[1:] - indptr[:-1]
    if not torch.equal(seq, lens):
        b = int(torch.nonzero(seq != lens)[0])
        raise err("seq_lens", f"seq_lens[{b}]={int(seq[b])} but kv_indptr gives {int(lens[b])} tokens")
    idx = cap.kv_indices.long()
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= N):
        j = int(torch.nonzero((idx < 0) | (idx >= N))[0])
        raise err("kv_indices", f"kv_indices[{j}]={int(idx[j])} out of range for kv_buffer with {N} rows")

    if cap.num_kv_splits is not None:
        shape("num_kv_splits", cap.num_kv_splits, (B,))
        if B and int(cap.num_kv_splits.min()) < 1:
            b = int(torch.nonzero(cap.num_kv_splits < 1)[0])
            raise err("num_kv_splits", f"num_kv_splits[{b}]={int(cap.num_kv_splits[b])} must be >= 1")
    rows = T  # rows of out / lse: requests in decode, tokens in extend
    if cap.out is not None:
        shape("out", cap.out, (rows, H, Dv))
    if cap.lse is not None:
        shape("lse", cap.lse, (rows, H))
    if cap.attn_logits is not None:
        shape("attn_logits", cap.attn_logits, (B, H, None, Dv))
    if cap.attn_lse is not None:
        S = cap.attn_logits.shape[2] if cap.attn_logits is not None else None
        shape("attn_lse", cap.attn_lse, (B, H, S))
    if cap.req_to_token is not None:
        shape("req_to_token", cap.req_to_token, (B, None))
    if cap.orig_kv_indices is not None:
        shape("orig_kv_indices", cap.orig_kv_indices, (cap.kv_indices.shape[0],))

    if cap.is_decode:
        if cap.qo_indptr is not None:
            warnings.append("qo_indptr is ignored in decode mode")
    else:
        if cap.qo_indptr is None:
            raise err("qo_indptr", "missing (required in extend mode)")
        shape("qo_indptr", cap.qo_indptr, (B + 1,))
        qo = cap.qo_indptr.long()
        if int(qo[0]) != 0 or bool((qo[1:] < qo[:-1]).any()):
            raise err("qo_indptr", "must start at 0 and be monotone")
        if int(qo[-1]) != T:
            raise err("qo_indptr", f"qo_indptr[-1]={int(qo[-1])} but q has {T} tokens")
        qlen = qo[1:] - qo[:-1]
        if bool((qlen > seq).any()):
            b = int(torch.nonzero(qlen > seq)[0])
            raise err("qo_indptr", f"request {b} has {int(qlen[b])} new tokens but seq_len {int(seq[b])}")

    if cap.q.dtype.itemsize == 1:
        warnings.append("q is fp8: the format carries no q scale, replayed as stored")
    bad_q = ~torch.isfinite(cap.q.float())
    if bool(bad_q.any()):
        r = int(torch.nonzero(bad_q)[0][0])
        warnings.append(f"q has {int(bad_q.sum())} NaN/Inf values (first in row {r}); replayed anyway")
    if m.backend not in ("triton", "aiter", "unknown"):
        warnings.append(f"meta backend {m.backend!r} is not one of triton, aiter, unknown")
    return warnings


# --------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------


def compact_pool(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Keep only the pool rows that kv_indices (and req_to_token up to each seq_len) reference.

    kv_indices and req_to_token are remapped to the compacted numbering; req_to_token entries
    past a request's seq_len become -1; orig_kv_indices keeps the physical slots.
    """
    t = dict(tensors)
    idx = t["kv_indices"].long()
    seq = t["seq_lens"].long()
    r2t = t.get("req_to_token")
    used = [idx]
    if r2t is not None:
        valid = torch.arange(r2t.shape[1])[None, :] < seq[:, None]  # [B, M]
        used.append(r2t.long()[valid & (r2t >= 0) & (r2t < t["kv_buffer"].shape[0])])
    rows = torch.unique(torch.cat(used))  # sorted physical slots
    orig = t.get("orig_kv_indices")
    t["orig_kv_indices"] = (orig.long() if orig is not None else idx).clone()
    t["kv_buffer"] = t["kv_buffer"].index_select(0, rows.to(t["kv_buffer"].device))
    t["kv_indices"] = torch.searchsorted(rows, idx).to(t["kv_indices"].dtype)
    if r2t is not None:
        M = int(seq.max()) if seq.numel() else 0
        r2t = r2t[:, :M].long()
        pos = torch.searchsorted(rows, r2t.clamp(min=0)).clamp(max=max(len(rows) - 1, 0))
        hit = (rows[pos] == r2t) if len(rows) else torch.zeros_like(r2t, dtype=torch.bool)
        keep = hit & (torch.arange(M)[None, :] < seq[:, None])
        t["req_to_token"] = torch.where(keep, pos, -1).to(tensors["req_to_token"].dtype)
    return t


def write_capture(
    path: Any,
    tensors: Mapping[str, torch.Tensor],
    meta: Mapping[str, Any],
    *,
    compact: bool = True,
    validate_first: bool = True,
) -> Path:
    """Write a capture atomically (temp file in the same folder, then rename).

    ``tensors`` and ``meta`` follow CONTRACT section 1. With ``compact``, the pool is reduced
    to the referenced rows (see :func:`compact_pool`). The result is validated before anything
    is written, so a file on disk is always a readable capture.
    """
    from safetensors.torch import save_file

    path = Path(path)
    unknown = set(tensors) - set(TENSORS)
    if unknown:
        raise CaptureError(path, f"tensor '{sorted(unknown)[0]}'", "not part of refmla.capture/1")
    t = {k: v.detach().to("cpu") for k, v in tensors.items() if v is not None}
    if compact:
        t = compact_pool(t)
    parsed = parse_meta(dict(meta), path)
    if validate_first:
        validate(Capture(path=str(path), meta=parsed, **t))
    header = {"format": CAPTURE_FORMAT, "meta": json.dumps(parsed.to_json(), sort_keys=True)}
    t = {k: v.contiguous() for k, v in t.items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        save_file(t, str(tmp), metadata=header)
        _sort_header_metadata(tmp)
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


def _sort_header_metadata(path: Path) -> None:
    """Sort the safetensors ``__metadata__`` keys in place (same length, same meaning), so the same
    capture is the same bytes: safetensors writes them from a hash map, in any order."""
    with open(path, "r+b") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
        header["__metadata__"] = dict(sorted(header.get("__metadata__", {}).items()))
        text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
        if len(text) <= n:  # a reordering of the same keys never grows; keep the file if it would
            f.seek(8)
            f.write(text + b" " * (n - len(text)))
