"""What each query row of a sparse decode call reads: its top-k entries in the main cache, then
its entries in the extra (compressed) cache, each valid when it is not -1 and stands before the
request's ``topk_length``. Built once here; the reference, the control and the fault search read it.

Entries are attended as listed: the union of both caches' valid entries (a token listed twice
counts twice, as every kernel computes it). A row with no valid entry is "lonely" (FlashMLA's
convention: output 0, lse +inf).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class SparseRows:
    token: torch.Tensor  # [R, Kt] int64 flat token index into its pool (0 where invalid); R = B * S
    valid: torch.Tensor  # [R, Kt] bool
    pool_id: torch.Tensor  # [Kt] int8: 0 the main cache, 1 the extra cache
    request: torch.Tensor  # [R] int64: the request of each row

    @property
    def lonely(self) -> torch.Tensor:
        """[R] rows with no valid entry."""
        return ~self.valid.any(dim=1)


def scope_valid(indices: torch.Tensor, lengths: Optional[torch.Tensor]) -> torch.Tensor:
    """[B, S, K] indices -> [B * S, K] valid: not -1 and (with lengths [B]) before topk_length[b]."""
    B, S, K = indices.shape
    valid = indices != -1
    if lengths is not None:
        valid = valid & (torch.arange(K)[None, None, :] < lengths.long().view(B, 1, 1))
    return valid.reshape(B * S, K)


def sparse_rows(indices: torch.Tensor, lengths: Optional[torch.Tensor] = None,
                extra_indices: Optional[torch.Tensor] = None,
                extra_lengths: Optional[torch.Tensor] = None) -> SparseRows:  # fmt: skip
    B, S, K = indices.shape
    scopes = [(indices, lengths)] + ([(extra_indices, extra_lengths)] if extra_indices is not None else [])
    tokens, valids, ids = [], [], []
    for pool, (idx, ln) in enumerate(scopes):
        v = scope_valid(idx, ln)  # [R, K_pool]
        tokens.append(torch.where(v, idx.reshape(B * S, -1).long(), 0))
        valids.append(v)
        ids.append(torch.full((idx.shape[2],), pool, dtype=torch.int8))
    return SparseRows(torch.cat(tokens, 1), torch.cat(valids, 1), torch.cat(ids), torch.arange(B).repeat_interleave(S))


__all__ = ["SparseRows", "scope_valid", "sparse_rows"]
