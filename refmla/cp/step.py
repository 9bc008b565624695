"""A folder of one decode step's rank captures (meta ``dcp_*``): read, the metadata the ranks
agree on, each rank's shard rows, the whole (unsharded) context they add up to.

The geometry is refmla.capture.dcp's: position p of a request is on rank (p // I) % W at local row
(p // (W I)) I + p % I. A rank's shard of request b is its local rows 0..n-1, n =
local_lens(dcp_tot_seq_lens[b]); the rows come from its block table (every page the table names
is kept in the capture), or, without one, from kv_indices (the rows the kernel read: a kernel
handed fewer than n leaves the rest of the shard out, and that request's whole context unknown).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from refmla.capture import Capture, CaptureError, read_capture
from refmla.capture import dcp
from refmla.cp.result import CpFinding

AGREED = ("dcp_world_size", "dcp_interleave_size", "kv_lora_rank", "qk_rope_head_dim", "sm_scale", "logit_cap",
          "k_scale", "v_scale", "rids", "layer_id", "step")  # fmt: skip  (meta every rank of a step shares)


@dataclass
class CpStep:
    folder: str
    ranks: dict  # rank -> Capture
    world: int
    interleave: int
    total: torch.Tensor  # [B] int64 each request's whole length (the agreed dcp_tot_seq_lens)
    findings: list = field(default_factory=list)  # cp_rank_metadata / cp_shard_missing / cp_local_length
    shard: dict = field(default_factory=dict)  # rank -> [per request: pool rows [n_b] int64]
    short: set = field(default_factory=set)  # (rank, request) whose shard rows are not all in the capture

    @property
    def any(self) -> Capture:
        return self.ranks[min(self.ranks)]

    def missing(self) -> list[int]:
        return [r for r in range(self.world) if r not in self.ranks]

    def whole(self, b: int) -> Optional[torch.Tensor]:
        """Request b's whole context [L, D] in the pool's dtype, position by position, or None
        when a rank holding part of it is missing."""
        if self.missing() or any(rb[1] == b for rb in self.short):
            return None
        L, first = int(self.total[b]), self.any.kv_buffer
        kv = first.new_empty((L, first.shape[-1]))
        for r, cap in self.ranks.items():
            rows = self.shard[r][b]
            kv[dcp.positions(r, rows.numel(), self.world, self.interleave)] = cap.kv_buffer[:, 0].index_select(0, rows)
        return kv


def captures_in(folder: Any) -> list[Path]:
    p = Path(folder)
    if not p.is_dir():
        raise CaptureError(p, "folder", "not a folder of one step's rank captures")
    files = sorted(f for f in p.iterdir() if f.suffix == ".safetensors" and f.is_file())
    if not files:
        raise CaptureError(p, "folder", "holds no .safetensors captures")
    return files


def steps_in(folder: Any) -> list[tuple[str, list]]:
    """The folder's captures grouped into steps by (layer, step), as the hook writes every rank,
    layer and step into one folder: [(label, [(path, Capture)])], in (layer, step) order. One
    group is labelled with the folder alone."""
    groups: dict[tuple, list] = {}
    for f in captures_in(folder):
        cap = read_capture(f)
        key = (cap.meta.layer_id if cap.meta.layer_id is not None else -1, cap.meta.step if cap.meta.step is not None else -1)
        groups.setdefault(key, []).append((f, cap))
    if len(groups) == 1:
        return [(str(folder), next(iter(groups.values())))]
    return [(f"{folder} (layer {k[0]}, step {k[1]})", v) for k, v in sorted(groups.items())]


def read_step(folder: Any, captures: Optional[list] = None, label: Optional[str] = None) -> CpStep:
    """The step in ``folder`` (or the given [(path, Capture)] of one step); CaptureError (exit 2)
    names the file and key that make it unusable."""
    caps: dict[int, Capture] = {}
    for f, cap in captures if captures is not None else [(f, read_capture(f)) for f in captures_in(folder)]:
        m = cap.meta
        if m.dcp_world_size is None:
            raise CaptureError(f, "meta key 'dcp_world_size'", "missing: not a context-parallel rank capture")
        if m.dcp_rank in caps:
            raise CaptureError(f, "meta key 'dcp_rank'", f"rank {m.dcp_rank} also in {caps[m.dcp_rank].path}")
        if m.mode != "decode":
            raise CaptureError(f, "meta key 'mode'", f"{m.mode!r}: context-parallel steps are decode")
        caps[m.dcp_rank] = cap
    findings: list[CpFinding] = []
    agreed = {key: _agree(caps, key, findings) for key in AGREED}
    _check_shapes(caps, agreed["dcp_world_size"])
    total = _agreed_total(caps, agreed["dcp_world_size"], agreed["dcp_interleave_size"], findings)
    _check_q(caps, findings)
    step = CpStep(label or str(folder), caps, agreed["dcp_world_size"], agreed["dcp_interleave_size"], total, findings)
    for r in step.missing():
        n = dcp.local_lens(total, step.world, r, step.interleave)
        pos = [dcp.ranges(dcp.positions(r, int(k), step.world, step.interleave)) for k in n]
        findings.append(CpFinding("cp_shard_missing", r, None, pos[0] if len(pos) == 1 else [],
                                  f"rank {r} of {step.world}: no capture in the folder; it holds "
                                  f"{int(n.sum())} positions of the step", {"positions_by_request": pos}))  # fmt: skip
    for r, cap in caps.items():
        step.shard[r] = _shard_rows(step, r, cap)
    return step


def _agree(caps: dict, key: str, findings: list) -> Any:
    """The value most ranks have (ties: the lowest rank's); each rank that differs is a finding."""
    values = {r: _hashable(getattr(c.meta, key)) for r, c in caps.items()}
    counts = Counter(values.values())
    best = max(counts.values())
    value = next(v for r, v in sorted(values.items()) if counts[v] == best)
    for r, v in sorted(values.items()):
        if v != value:
            findings.append(CpFinding("cp_rank_metadata", r, None, [], f"rank {r}: meta {key} {v!r}, the other "
                                      f"ranks' {value!r}", {"key": key, "value": v, "others": value}))  # fmt: skip
    return list(value) if isinstance(value, tuple) else value


def _check_shapes(caps: dict, W: int) -> None:
    """What the ranks' tensors must share to add up to one call (the requests, the heads, the row
    width, every rank below W); CaptureError names the first capture that does not."""
    r0 = min(caps)
    ref = caps[r0]
    for r, c in sorted(caps.items()):
        if r >= W:
            raise CaptureError(c.path, "meta key 'dcp_rank'", f"{r} is not below the ranks' dcp_world_size {W}")
        if c.q.shape != ref.q.shape or c.kv_buffer.shape[1:] != ref.kv_buffer.shape[1:]:
            raise CaptureError(c.path, "tensor 'q'", f"shape {list(c.q.shape)} / pool rows {list(c.kv_buffer.shape[1:])} "
                               f"differ from {ref.path}'s: not one step's ranks")  # fmt: skip
        if (c.out is None) != (ref.out is None) or (c.dcp_out is not None and ref.dcp_out is not None
                                                     and c.dcp_out.shape != ref.dcp_out.shape):  # fmt: skip
            raise CaptureError(c.path, "tensor 'out'", f"present / shaped unlike {ref.path}'s")


def _hashable(v: Any) -> Any:
    return tuple(v) if isinstance(v, list) else v


def _agreed_total(caps: dict, W: int, I: int, findings: list) -> torch.Tensor:
    """dcp_tot_seq_lens as the ranks agree: the value most ranks' own seq_lens follow from (a tie,
    DCP 2, is broken by that); each rank that differs is named with the requests and positions."""
    tots = {r: c.meta.dcp_tot_seq_lens for r, c in caps.items()}
    for r, t in tots.items():
        if t is None:
            raise CaptureError(caps[r].path, "meta key 'dcp_tot_seq_lens'", "missing: the whole lengths are needed")
    cands = {tuple(t) for t in tots.values()}

    def score(t):  # ranks holding this value, ranks whose kernel lengths follow from it
        follow = sum(bool(torch.equal(dcp.local_lens(torch.tensor(t), W, r, I), c.seq_lens.long())) for r, c in caps.items())
        return (sum(tuple(v) == t for v in tots.values()), follow, -min(r for r, v in tots.items() if tuple(v) == t))

    best = max(cands, key=score)
    for r, t in sorted(tots.items()):
        if tuple(t) != best:
            for b, (x, y) in enumerate(zip(t, best)):
                if x != y:
                    findings.append(CpFinding("cp_rank_metadata", r, b, [[min(x, y), max(x, y)]],
                                              f"rank {r}, request {b}: dcp_tot_seq_lens {x}, the other ranks' {y}; "
                                              f"positions [{min(x, y)}, {max(x, y)}) are in doubt",
                                              {"key": "dcp_tot_seq_lens", "value": x, "others": y}))  # fmt: skip
    return torch.tensor(best, dtype=torch.int64)


def _check_q(caps: dict, findings: list) -> None:
    """Every rank attends the same gathered queries: a rank whose q differs from rank 0's (or the
    lowest present) is named."""
    r0 = min(caps)
    for r, c in sorted(caps.items()):
        if r != r0 and (c.q.shape != caps[r0].q.shape or not torch.equal(c.q, caps[r0].q)):
            findings.append(CpFinding("cp_rank_metadata", r, None, [], f"rank {r}: its queries differ from rank "
                                      f"{r0}'s (DCP gathers one q for every rank)", {"key": "q"}))  # fmt: skip


def _shard_rows(step: CpStep, r: int, cap: Capture) -> list[torch.Tensor]:
    """Rank r's pool rows of each request's shard, local row order. A kernel length that differs
    from the geometry's is a cp_local_length finding naming the positions it dropped or added."""
    n = dcp.local_lens(step.total, step.world, r, step.interleave)  # [B]
    seq = cap.seq_lens.long()
    rows = []
    P = cap.meta.page_size
    for b in range(n.numel()):
        k, want = int(seq[b]), int(n[b])
        if k != want:
            lo, hi = min(k, want), max(k, want)
            pos = dcp.positions(r, hi, step.world, step.interleave)[lo:]
            what = "dropped" if k < want else "read past its shard"
            step.findings.append(CpFinding(
                "cp_local_length", r, b, dcp.ranges(pos),
                f"rank {r}, request {b}: its kernel attended {k} rows, its shard of {int(step.total[b])} positions "
                f"holds {want}; {what}: {_runs(dcp.ranges(pos))}", {"kernel_len": k, "shard_len": want, "source": "metadata"}))
        if cap.block_table is not None:
            cols = -(-want // P)
            if cols > cap.block_table.shape[1] or bool((cap.block_table[b, :cols] < 0).any()):
                raise CaptureError(cap.path, "tensor 'block_table'", f"request {b}: does not cover the shard's {want} rows")
            j = torch.arange(want)
            rows.append(cap.block_table[b].long()[j // P] * P + j % P)
            if want and int(rows[-1].max()) >= cap.kv_buffer.shape[0]:
                raise CaptureError(cap.path, "tensor 'block_table'", f"request {b}: the shard's rows pass the pool's end")
        elif k <= want:  # a kernel handed fewer rows: those it read (the rest of the shard is not in the capture)
            rows.append(cap.kv_indices[int(cap.kv_indptr[b]):int(cap.kv_indptr[b + 1])].long())
            if k < want:
                step.short.add((r, b))
        else:
            raise CaptureError(cap.path, "tensor 'block_table'", f"request {b}: missing; without it the shard's "
                               f"{want} rows are not in the capture (its kernel read {k})")  # fmt: skip
    return rows


def _runs(r: list) -> str:
    text = ", ".join(f"[{a}, {b})" for a, b in r[:4])
    return text + (f" and {len(r) - 4} more runs" if len(r) > 4 else "")


__all__ = ["AGREED", "CpStep", "captures_in", "read_step", "steps_in"]
