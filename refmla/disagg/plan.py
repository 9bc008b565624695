"""Which prefill captures hold each decode request, by layer and rank, from the headers alone.

A decode *series* is the decode captures of one (layer_id, tp_rank), in step order
(refmla.series.group_series). A request's *first* decode capture in its series is the one whose
KV is diffed against the prefill side (the transfer landed before that step; later changes of
its rows are the series check's ``kv_rows_changed``). The prefill captures of a request are
those of the same layer and rank whose ``rids`` hold its rid -- several for chunked prefill --,
else those of the same layer on any rank (MLA's latent KV is the same on every TP rank). A request no
prefill capture holds by rid, in a decode capture that records its rows' token ids, gets every prefill
capture of its layer that records them too: diff-kv pairs its rows by tokens (refmla.diffkv.tokens), so a
prefix that came back from a prefix cache or a host tier is compared with the capture that wrote it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

from refmla.capture import CaptureError, check_file, parse_meta
from refmla.capture.read import safetensors_open
from refmla.region_check import RegionCheck, check_region
from refmla.series import _header, group_series
from refmla.sparse.format import SparseMeta, is_sparse_meta, parse_sparse_meta

Key = tuple  # (layer_id, tp_rank)


@dataclass
class Header:
    path: str
    layer: Optional[int]
    rank: Optional[int]
    step: Optional[int]
    rids: Optional[list[str]]
    meta: object  # CaptureMeta, or SparseMeta (a sparse decode capture)
    tokens: bool = False  # the capture records its rows' token ids (kv_token_ids): diff-kv pairs them by tokens

    def region(self) -> RegionCheck:
        """The MR region-size check of the capture's pool geometry (refmla.region_check)."""
        return self.meta.region() if isinstance(self.meta, SparseMeta) else check_region(self.meta)


@dataclass
class DiffJob:
    """One diff-kv: a decode capture against the prefill captures holding its newly seen rids."""

    decode: str
    prefill: list[str]
    rids: list[str]  # the rids whose transfer this diff answers


@dataclass
class DisaggPlan:
    prefill: dict[str, Header]
    decode: dict[str, Header]
    series: dict[Key, list[str]]  # decode series in step order
    jobs: list[DiffJob] = field(default_factory=list)
    first_capture: dict[tuple, str] = field(default_factory=dict)  # (rid, layer, rank) -> its diffed decode capture
    prefill_of: dict[tuple, list[str]] = field(default_factory=dict)  # (rid, layer, rank) -> prefill captures
    invalid: list[tuple[str, str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    writers: list = field(default_factory=list)  # ReplayReport of each prefill KV writer capture (refmla.disagg.writer)


def read_header(path: str) -> Header:
    """The capture's meta from its header (no tensor read); CaptureError when unreadable or invalid."""
    check_file(path)  # a missing file says so, as replay's reader does
    raw = _header(path)
    if raw is None:
        raise CaptureError(path, "header", "not a readable refmla.capture/1 safetensors file")
    meta = parse_sparse_meta(raw, path) if is_sparse_meta(raw) else parse_meta(raw, path)
    return Header(path, meta.layer_id, meta.tp_rank, meta.step, meta.rids, meta, "kv_token_ids" in tensor_names(path))


def tensor_names(path: str) -> set:
    """The tensors a capture holds, from its header (none read); empty when unreadable."""
    try:
        with safetensors_open(path) as f:
            return set(f.keys())
    except Exception:
        return set()


def _headers(paths: Sequence[str], invalid: list) -> dict[str, Header]:
    out = {}
    for p in paths:
        try:
            out[p] = read_header(p)
        except CaptureError as e:
            invalid.append((p, str(e)))
    return out


def plan_disagg(prefill_paths: Sequence[str], decode_paths: Sequence[str]) -> DisaggPlan:
    """Headers of both sides, the decode series, and one diff job per decode capture with new rids."""
    invalid: list[tuple[str, str]] = []
    plan = DisaggPlan(_headers(prefill_paths, invalid), _headers(decode_paths, invalid), {}, invalid=invalid)
    plan.series = group_series([p for p in decode_paths if p in plan.decode])
    by_layer: dict[Optional[int], list[Header]] = {}
    for h in plan.prefill.values():
        by_layer.setdefault(h.layer, []).append(h)
    for (layer, rank), paths in plan.series.items():
        seen: set[str] = set()
        for path in paths:
            h = plan.decode[path]
            if h.rids is None:
                plan.notes.append(f"{path}: no rids in meta; its requests cannot be paired with the prefill side")
                continue
            new = [r for r in dict.fromkeys(h.rids) if r not in seen]
            seen.update(new)
            needed: list[str] = []
            for rid in new:
                plan.first_capture[(rid, layer, rank)] = path
                holders = _holders(by_layer.get(layer, []), rid, rank)
                if not holders and h.tokens:  # its rows may be another rid's (a prefix cache, a host tier): by tokens
                    holders = _holders(by_layer.get(layer, []), None, rank)
                plan.prefill_of[(rid, layer, rank)] = holders
                needed += [p for p in holders if p not in needed]
            paired = [r for r in new if plan.prefill_of[(r, layer, rank)]]
            if paired:
                plan.jobs.append(DiffJob(path, sorted(needed, key=lambda p: _order(plan.prefill[p])), paired))
    note = layout_mismatch(list(plan.prefill.values()), list(plan.decode.values()))
    if note:
        plan.notes.append(note)
    return plan


def is_sparse(h: Header) -> bool:
    return isinstance(h.meta, SparseMeta)


def layout_mismatch(prefill: list[Header], decode: list[Header]) -> Optional[str]:
    """The sentence when no prefill capture has the decode captures' KV layout (dense MLA against
    DeepSeek V3.2 / V4 sparse, or the reverse): no transfer can be compared; None otherwise."""
    if not prefill or not decode or {is_sparse(h) for h in prefill} & {is_sparse(h) for h in decode}:
        return None
    side = {True: "sparse (DeepSeek V3.2 / V4 layout)", False: "dense (MLA latent pool)"}
    return (f"meta key 'mode': the prefill captures are {side[is_sparse(prefill[0])]} ({prefill[0].path}, ...) and "
            f"the decode captures {side[is_sparse(decode[0])]} ({decode[0].path}, ...): the two sides' KV layouts "
            f"differ, so no request's transfer can be compared (a dense pool and a sparse one)")  # fmt: skip


def _holders(prefill: list[Header], rid: Optional[str], rank: Optional[int]) -> list[str]:
    """Prefill captures of the layer holding ``rid`` (None: every one that records its rows' token ids,
    paired by tokens): same rank first, else any rank (the lowest)."""
    holding = [h for h in prefill if (h.tokens if rid is None else h.rids is not None and rid in h.rids)]
    same = [h for h in holding if h.rank == rank]
    if not same and holding:
        lowest = min((h.rank for h in holding), key=lambda r: (r is None, r))
        same = [h for h in holding if h.rank == lowest]
    return [h.path for h in sorted(same, key=_order)]


def _order(h: Header) -> tuple:
    """Chunk captures in step order (the diff's owner rule needs no order, the report reads better)."""
    return (h.step is None, h.step if h.step is not None else 0, h.path)
