"""What each query row of a sparse decode call reads, padded for vectorized math: built from the
one description every consumer shares, :meth:`refmla.attended.Attended.sparse_topk` (a row's
entries in the main cache that are not -1 and stand before its request's ``topk_length``, then its
entries in the extra, compressed, cache).

Entries are attended as listed: the union of both caches' valid entries (a token listed twice
counts twice, as every kernel computes it). A row with no valid entry is "lonely" (FlashMLA's
convention: output 0, lse +inf).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from refmla.attended import Attended


@dataclass(frozen=True)
class SparseRows:
    token: torch.Tensor  # [R, W] int64 flat token index into its pool (0 where not valid); R = B * S
    valid: torch.Tensor  # [R, W] bool
    pool_id: torch.Tensor  # [R, W] int8: 0 the main cache, 1 the extra cache
    request: torch.Tensor  # [R] int64: the request of each row

    def part(self, sl: slice) -> "SparseRows":
        """The rows ``sl`` (a block of query rows)."""
        return SparseRows(self.token[sl], self.valid[sl], self.pool_id[sl], self.request[sl])

    @property
    def lonely(self) -> torch.Tensor:
        """[R] rows with no valid entry."""
        return ~self.valid.any(dim=1)


def padded(att: Attended, request: torch.Tensor) -> SparseRows:
    """An Attended of one group per query row as [R, W] entries (W its longest group, at least 1)."""
    R, lens = att.num_rows, att.lengths()
    W = max(1, att.max_length())
    valid = torch.arange(W)[None, :] < lens[:, None]  # [R, W]
    token = torch.zeros(R, W, dtype=torch.long)
    token[valid] = att.rows
    pool = torch.zeros(R, W, dtype=torch.int8)
    if att.pool_ids is not None:
        pool[valid] = att.pool_ids
    return SparseRows(token, valid, pool, request)


def per_row(lengths: Optional[torch.Tensor], S: int) -> Optional[torch.Tensor]:
    """topk_length [B] (per request) -> [B * S] (per query row)."""
    return None if lengths is None else lengths.long().repeat_interleave(S)


def sparse_rows(indices: torch.Tensor, lengths: Optional[torch.Tensor] = None,
                extra_indices: Optional[torch.Tensor] = None,
                extra_lengths: Optional[torch.Tensor] = None) -> SparseRows:  # fmt: skip
    """indices [B, S, K] (extra [B, S, K2]), lengths [B] -> the rows every query row reads."""
    B, S, K = indices.shape
    att = Attended.sparse_topk(indices.reshape(B * S, K), per_row(lengths, S),
                               None if extra_indices is None else extra_indices.reshape(B * S, extra_indices.shape[-1]),
                               per_row(extra_lengths, S))  # fmt: skip
    return padded(att, torch.arange(B).repeat_interleave(S))


def raw_rows(indices: torch.Tensor, lengths: Optional[torch.Tensor] = None,
             extra_indices: Optional[torch.Tensor] = None,
             extra_lengths: Optional[torch.Tensor] = None) -> SparseRows:  # fmt: skip
    """Every entry of both lists, each -1 and each entry past its length read as token 0: what a
    kernel reads that takes -1 for a slot once the lengths are folded into -1 (as SGLang does for
    aiter_sparse): the hypothesis ``minus_one_as_slot0``."""
    B, S, _ = indices.shape
    scopes = [(indices, lengths)] + ([(extra_indices, extra_lengths)] if extra_indices is not None else [])
    tokens, pools = [], []
    for pool, (idx, ln) in enumerate(scopes):
        x = idx.reshape(B * S, idx.shape[-1]).long()
        past = torch.zeros_like(x, dtype=torch.bool) if ln is None else torch.arange(x.shape[1])[None] >= per_row(ln, S)[:, None]
        tokens.append(torch.where((x == -1) | past, 0, x))
        pools.append(torch.full(x.shape, pool, dtype=torch.int8))
    token = torch.cat(tokens, 1)
    return SparseRows(token, torch.ones_like(token, dtype=torch.bool), torch.cat(pools, 1), torch.arange(B).repeat_interleave(S))


__all__ = ["SparseRows", "padded", "per_row", "raw_rows", "sparse_rows"]
