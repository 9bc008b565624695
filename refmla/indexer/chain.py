"""A sparse decode capture's indices judged by the indexer capture beside it.

The hook writes the indexer's call next to the sparse decode call of the same layer and step: a
file in the same folder with meta ``mode`` ``indexer`` and the same ``layer_id``, ``tp_rank``,
``step`` and ``rids``. The index set the decode read (V3.2: ``indices``; V4 C4: ``extra_indices``,
the compressed cache's; entries past ``topk_length`` dropped), as production slots (through
``k_cache_pages``), is judged against the indexer's fp64 top-k (refmla.indexer.reference) and a
wrong set explained (refmla.indexer.hypotheses). The result is the report's ``indexer`` entry; a
wrong set makes the verdict ``diverged`` with diagnosis ``upstream_indexer`` whether the decode
agrees over it or not: attention computed right over the wrong entries is still wrong.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import torch

from refmla.capture.format import CaptureError
from refmla.indexer.format import MODE
from refmla.indexer.io import read_indexer
from refmla.indexer.judge import set_entry
from refmla.indexer.reference import Scores
from refmla.results import BackendEntry, ReplayReport

KEYS = ("layer_id", "tp_rank", "step", "rids")


def _meta(path: Path) -> dict:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            meta = json.loads((f.metadata() or {}).get("meta", "{}"))
        return meta if isinstance(meta, dict) else {}
    except Exception:
        return {}


_FOLDERS: dict = {}  # folder -> (its mtime, [(path, meta)] of its indexer captures): each header read once


def _indexers(folder: Path) -> list:
    try:
        stamp = folder.stat().st_mtime_ns
    except OSError:
        return []
    if _FOLDERS.get(folder, (None,))[0] != stamp:
        found = [(p, m) for p in sorted(folder.glob("*.safetensors")) if (m := _meta(p)).get("mode") == MODE]
        _FOLDERS[folder] = (stamp, found)
    return _FOLDERS[folder][1]


def beside(cap: Any) -> Optional[Path]:
    """The indexer capture in the sparse capture's folder with its layer, rank, step and rids, or None."""
    here = Path(cap.path)
    want = {k: (getattr(cap.meta, k, None)) for k in KEYS}
    want["rids"] = [str(r) for r in want["rids"]] if want["rids"] is not None else None
    for p, m in _indexers(here.parent):
        if p != here and all(m.get(k) == v for k, v in want.items() if v is not None):
            return p
    return None


def decode_values(cap: Any, icap: Any) -> torch.Tensor:
    """[B, K] the entries the decode read, in the indexer capture's numbering; ValueError says why
    they cannot be compared."""
    extra = icap.meta.compress_ratio > 1
    idx = cap.extra_indices if extra else cap.indices
    lens = cap.extra_topk_length if extra else cap.topk_length
    pages = cap.extra_k_cache_pages if extra else cap.k_cache_pages
    ps = cap.meta.extra_page_size if extra else cap.meta.page_size
    if idx is None:
        raise ValueError("the decode read no compressed cache, the indexer scores one" if extra else "no indices")
    B, S, K = idx.shape
    if S != icap.next_n or B * S != icap.q.shape[0]:
        raise ValueError(f"the decode has {B} requests x {S} tokens, the indexer {icap.q.shape[0] // icap.next_n} "
                         f"requests x {icap.next_n}")  # fmt: skip
    if ps != icap.meta.page_size:
        raise ValueError(f"the decode's cache has pages of {ps}, the indexer's of {icap.meta.page_size}")
    v = idx.reshape(B * S, K).long().clone()  # one row a query token (MTP: request-major, as the indexer's)
    B = B * S
    if lens is not None:
        v[torch.arange(K)[None, :] >= lens.long().repeat_interleave(S)[:, None]] = -1
    if pages is not None:
        v = torch.where(v >= 0, pages.long()[v.clamp(min=0) // ps] * ps + v % ps, v)
    if icap.meta.indices_kind == "positions":
        from refmla.indexer.reference import positions

        v = torch.stack([_as_positions(icap, b, v[b], positions) for b in range(B)])
    out = torch.full((B, max(K, icap.meta.topk)), -1, dtype=torch.int64)
    out[:, :K] = v
    return out[:, : max(K, icap.meta.topk)]


def _as_positions(icap, b, row, positions) -> torch.Tensor:
    keep = row != -1
    out = torch.full_like(row, -1)
    out[keep] = positions(icap, b, row[keep], kind="slots")
    return out


def attach(cap: Any, report: ReplayReport, opts: Any) -> None:
    """Judge the decode's indices by the indexer capture beside it (module docstring); nothing when none is."""
    path = beside(cap)
    if path is None:
        return
    report.kind_keys["indexer_capture"] = str(path)
    try:
        icap = read_indexer(path).flat()  # an MTP capture: one row a query token
        values = decode_values(cap, icap)
    except (CaptureError, ValueError) as e:
        report.backends["indexer"] = BackendEntry("skipped", reason=f"{path.name}: {e}")
        return
    tol = getattr(opts, "tol", None)
    entry = set_entry(icap, values, Scores(icap, tol.k if tol is not None else 2.0), getattr(opts, "explain", True),
                      {"indexer_capture": str(path), "what": "the index set the decode read"})  # fmt: skip
    report.backends["indexer"] = entry
    if entry.status == "pass":
        return
    why = f"; {entry.explanation.text()}" if entry.explanation is not None else ""
    decode_ok = report.verdict == "agree"
    report.verdict = "diverged"
    before = [b for b in (report.diagnosis_backends or []) if b != "indexer"]
    report.diagnosis_backends = ["indexer", *before]
    if decode_ok:
        text = "the decode attended the entries it was handed correctly, but the indexer chose the wrong entries"
    else:
        text = (f"the indexer chose the wrong entries, upstream of the decode's own divergence "
                f"({report.diagnosis}: {report.diagnosis_text})")  # fmt: skip
    report.diagnosis = "upstream_indexer"
    report.diagnosis_text = f"{text}: {entry.reason}{why}"


__all__ = ["attach", "beside", "decode_values"]
