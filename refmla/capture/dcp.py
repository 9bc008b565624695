"""Decode context parallelism's shard geometry (meta ``dcp_world_size``, ``dcp_rank``,
``dcp_interleave_size``; docs/context-parallel.md): which rank holds which token position.

With W ranks and interleave I (vLLM's ``cp_kv_cache_interleave_size``), position p of a request
lives on rank ``(p // I) % W``, at that rank's local row ``(p // (W * I)) * I + p % I``: runs of I
positions dealt round-robin to the ranks. Plain torch, no refmla import: the hook, the capture
checks and refmla.cp read the one copy.
"""

from __future__ import annotations

import torch


def owner(p: torch.Tensor, world: int, interleave: int) -> torch.Tensor:
    """The rank holding each global position p (int tensor)."""
    return (p // interleave) % world


def local_row(p: torch.Tensor, world: int, interleave: int) -> torch.Tensor:
    """Each global position's row within its owner's shard."""
    return (p // (world * interleave)) * interleave + p % interleave


def positions(rank: int, n: int, world: int, interleave: int) -> torch.Tensor:
    """The global positions of a rank's local rows 0..n-1 [n] int64 (the inverse of local_row)."""
    j = torch.arange(int(n), dtype=torch.int64)
    return (j // interleave) * world * interleave + rank * interleave + j % interleave


def local_lens(total: torch.Tensor, world: int, rank: int, interleave: int) -> torch.Tensor:
    """Rows the rank holds of requests of ``total`` [B] positions: the count of p < L it owns."""
    L = total.long()
    full = L // (world * interleave)  # whole rounds of W * I positions
    rest = (L - full * world * interleave - rank * interleave).clamp(min=0, max=interleave)
    return full * interleave + rest


def ranges(p: torch.Tensor) -> list[list[int]]:
    """Sorted positions as [start, end) runs: what a finding names."""
    out: list[list[int]] = []
    for x in sorted(int(v) for v in p.tolist()):
        if out and out[-1][1] == x:
            out[-1][1] = x + 1
        else:
            out.append([x, x + 1])
    return out


__all__ = ["local_lens", "local_row", "owner", "positions", "ranges"]
