"""The capture kinds with tensors of their own (meta ``mode`` ``kv_write``, ``merge``): the same
``refmla.capture/1`` container, read lazily and validated, written validated and atomically.

Each kind states its tensors (name -> required), a meta parser and its capture class (a
:class:`Kind`); the shared meta keys are :class:`KindMeta` (refmla.kvwrite.io, refmla.merge.io).
"""

from __future__ import annotations

import json
from pathlib import Path
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Mapping, Optional

import torch

from refmla import CAPTURE_FORMAT
from refmla.atomic import write_bytes
from refmla.capture.format import CaptureError
from refmla.capture.read import open_capture
from refmla.capture.write import sorted_header, unshared


@dataclass
class KindCapture:
    """What every kind's capture class shares: the file it came from, its meta, the reader's
    warnings; its own checks (:meth:`validate`, CaptureError naming the tensor) run on construction."""

    path: str
    meta: Any
    warnings: list = field(default_factory=list, kw_only=True)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        raise NotImplementedError


@dataclass(kw_only=True)
class KindMeta:
    """The meta keys every kind here shares; a kind's meta subclasses it with its own keys."""

    engine: Optional[str] = None
    engine_version: Optional[str] = None
    layer_id: Optional[int] = None
    tp_rank: Optional[int] = None
    step: Optional[int] = None
    rids: Optional[list] = None
    extra: dict = field(default_factory=dict)  # keys this version does not know, kept as given

    def to_json(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "extra"}
        return {**self.extra, **{k: v for k, v in d.items() if v is not None}}

    def where(self) -> str:
        """"  layer 3  rank 0  step 12", the parts that are known."""
        return "".join(f"  {w} {v}" for w, v in (("layer", self.layer_id), ("rank", self.tp_rank), ("step", self.step))
                       if v is not None)  # fmt: skip

    def read_common(self, raw: dict, path: Any, ints: tuple = (), strings: tuple = ()) -> "KindMeta":
        """The shared keys (and the kind's optional ``ints`` / ``strings``) from ``raw``, checked;
        unknown keys kept in ``extra``. CaptureError names the key."""
        known = {f.name for f in fields(self)} - {"extra"}
        self.extra = {k: v for k, v in raw.items() if k not in known}
        for key in ("layer_id", "tp_rank", "step", *ints):
            setattr(self, key, meta_int(raw, key, path, required=False))
        for key in ("engine", "engine_version", *strings):
            if raw.get(key) is not None:
                setattr(self, key, str(raw[key]))
        if raw.get("rids") is not None:
            if not isinstance(raw["rids"], list):
                raise CaptureError(path, "meta key 'rids'", "expected a list")
            self.rids = [str(r) for r in raw["rids"]]
        return self


def meta_int(raw: dict, key: str, path: Any, lo: int = 0, required: bool = True) -> Optional[int]:
    """An integer meta key in [lo, 2**31) (None when absent and not required); CaptureError names it."""
    v = raw.get(key)
    if v is None and not required:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v < 2**31:
        raise CaptureError(path, f"meta key '{key}'", f"expected an integer in [{lo}, 2**31), got {v!r}")
    return v


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


@dataclass(frozen=True)
class Kind:
    """A capture kind: its tensors (name -> required), its meta parser, its capture class (whose
    construction validates)."""

    spec: Mapping[str, bool]
    parse: Callable[[dict, Any], Any]
    build: Callable[..., Any]

    def read(self, path: Any) -> Any:
        """Open, parse the meta, map the tensors lazily, validate; CaptureError names the file."""
        path = Path(path)
        meta, loaded, names = open_capture(path, dict(self.spec), lambda p, h: self.parse(header_meta(p, h), p))
        cap = self.build(path=str(path), meta=meta, **loaded)
        unknown = sorted(names - set(self.spec))
        if unknown:
            cap.warnings.append(f"tensors not in this capture kind, ignored: {', '.join(unknown)}")
        return cap

    def write(self, path: Any, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> Path:
        """Validate, then write atomically (the file appears under its name only once complete)."""
        from safetensors.torch import save

        path = Path(path)
        parsed = self.parse(dict(meta), path)
        unknown = sorted(set(tensors) - set(self.spec))
        if unknown:
            raise CaptureError(path, f"tensor '{unknown[0]}'", "not part of this capture kind")
        t = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items() if v is not None}
        self.build(path=str(path), meta=parsed, **t)
        header = {"format": CAPTURE_FORMAT, "meta": json.dumps(parsed.to_json(), sort_keys=True)}
        write_bytes(path, sorted_header(save(unshared(t), metadata=header)), make_parents=True)
        return path


__all__ = ["Kind", "KindCapture", "KindMeta", "file_mode", "header_meta", "meta_int"]
