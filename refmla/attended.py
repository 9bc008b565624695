"""What each query row attends: the one description every consumer reads (bottom of the graph).

A call has R query rows (decode: B, one per request; extend / verify: T, the new tokens of every
request) and reads rows of one or more KV pools. Query rows are grouped: group g (a request of
today's token-index layout) owns the pool rows ``rows[indptr[g]:indptr[g + 1]]`` in position order,
and each of its query rows sees a part of them:

    indptr        [G + 1]  int64   group g owns rows[indptr[g] : indptr[g + 1]]   (L_g = its length)
    rows          [nnz]    int64   pool rows, position order within a group
    group_of_row  [R]      int64   the group each query row reads from (non-decreasing)
    causal_len    [R]      int64   query row t sees the first causal_len[t] rows of its group (None: all)
    mask          [M]      bool    per group a row-major [n_g, L_g] visibility block (a tree verify)
    mask_indptr   [G + 1]  int64   group g's block is mask[mask_indptr[g] : mask_indptr[g] + n_g * L_g]
    pool_ids      [nnz]    int8    the pool each entry of rows is in (0 main, 1 extra; None: one pool)

At most one of ``causal_len`` and ``mask`` is set. The reference, the control, the hypothesis
search and the backends' input builders read only this object; only :meth:`Attended.token_index`
(and its sibling constructors) read ``kv_indptr`` / ``kv_indices`` / ``qo_indptr`` / ``custom_mask``.

New layouts are one constructor each, building the same fields; no consumer changes:

- **block table** (vLLM / FlashMLA, issue 20): ``Attended.block_table(block_table [B, M], seq_lens [B],
  page_size, query_start_loc=None)``: group b's rows are ``block_table[b, j // page_size] * page_size +
  j % page_size`` for positions j < seq_lens[b]; causal_len as :meth:`token_index` computes it.
- **sparse top-k** (DeepSeek-V3.2 DSA): ``Attended.sparse_topk(indices [R, K], lengths [R])``: one
  group per query row (G = R, group_of_row = arange(R)), its rows the first lengths[r] entries of
  indices[r] that are not -1; no causal_len (the index set is the visibility).
- **two pools** (DeepSeek-V4: a sliding-window cache plus a compressed cache): a constructor that
  concatenates each group's window rows and compressed rows and sets ``pool_ids`` (0 / 1) per entry;
  consumers gather entry i from pool ``pool_ids[i]`` (:meth:`group_pools`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Mapping, Optional, Sequence, Union

import torch

EXPAND_ROWS = 1 << 20  # a block table is expanded this many positions at a time (8 MiB of int64 temporaries)

Positions = Union[slice, torch.Tensor]  # what a query row sees of its group's rows: a prefix, or a bool mask


@dataclass(frozen=True, eq=False)
class Attended:
    """The pool rows each query row reads (module docstring for the fields)."""

    indptr: torch.Tensor  # [G + 1] int64
    rows: torch.Tensor  # [nnz] int64
    group_of_row: torch.Tensor  # [R] int64, non-decreasing
    causal_len: Optional[torch.Tensor] = None  # [R] int64
    mask: Optional[torch.Tensor] = None  # [M] bool
    mask_indptr: Optional[torch.Tensor] = None  # [G + 1] int64
    pool_ids: Optional[torch.Tensor] = None  # [nnz] int8

    # ----------------------------------------------------------------------------------------
    # constructors
    # ----------------------------------------------------------------------------------------

    @classmethod
    def token_index(
        cls,
        kv_indptr: torch.Tensor,
        kv_indices: torch.Tensor,
        qo_indptr: Optional[torch.Tensor] = None,
        custom_mask: Optional[torch.Tensor] = None,
        mask_indptr: Optional[torch.Tensor] = None,
    ) -> "Attended":
        """SGLang's token-slot layout: request b reads kv_indices[kv_indptr[b]:kv_indptr[b + 1]].

        Decode (``qo_indptr`` None): one query row per request, seeing all of it. Extend / chain
        verify: request b's n_b query rows qo_indptr[b]:qo_indptr[b + 1] are its last n_b
        positions, bottom-right causal (new token i sees positions [0, L_b - n_b + i]). Tree verify
        (``custom_mask``): query i of request b sees the True entries of row i of its row-major
        [n_b, L_b] block at ``mask_indptr[b]`` (computed from n_b * L_b when not given).
        """
        indptr = kv_indptr.long().cpu()  # [B + 1]
        rows = kv_indices.long().cpu()  # [nnz]
        B = indptr.shape[0] - 1
        lens = indptr[1:] - indptr[:-1]  # [B]
        if qo_indptr is None:
            return cls(indptr, rows, torch.arange(B))
        qo = qo_indptr.long().cpu()  # [B + 1]
        n = qo[1:] - qo[:-1]  # [B]
        group_of_row = torch.repeat_interleave(torch.arange(B), n)  # [T]
        if custom_mask is not None:
            if mask_indptr is None:
                mask_indptr = torch.cat([torch.zeros(1, dtype=torch.long), (n * lens).cumsum(0)])
            return cls(indptr, rows, group_of_row, mask=(custom_mask != 0).cpu(), mask_indptr=mask_indptr.long().cpu())
        i = torch.arange(group_of_row.shape[0]) - qo[:-1][group_of_row]  # [T] index among the request's queries
        L, n_t = lens[group_of_row], n[group_of_row]  # [T]
        causal_len = torch.minimum(torch.clamp(L - n_t + i + 1, min=0), L)  # [T]
        return cls(indptr, rows, group_of_row, causal_len=causal_len)

    @classmethod
    def block_table(
        cls,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        page_size: int,
        query_start_loc: Optional[torch.Tensor] = None,
    ) -> "Attended":
        """A block table (vLLM, FlashMLA, FlashInfer / TRT-LLM, CUTLASS, FA3): group b reads
        positions j < seq_lens[b] at row ``block_table[b, j // page_size] * page_size + j % page_size``.
        ``query_start_loc`` (vLLM's multi-token decode, one table row per request): request b's
        query rows, bottom-right causal as :meth:`token_index`; None: one query row per table row
        (decode, and vLLM's TRITON_MLA call, which repeats a request's row per query row)."""
        P = int(page_size)
        lens = seq_lens.long().cpu()  # [B]
        kv_indptr = torch.zeros(lens.shape[0] + 1, dtype=torch.int64)
        kv_indptr[1:] = torch.cumsum(lens, 0)
        table = block_table.long().cpu()  # [B, M]
        kv_indices = torch.empty(int(kv_indptr[-1]), dtype=torch.int64)  # [sum L], filled in place
        offsets = torch.arange(P)  # [P]
        step = max(1, EXPAND_ROWS // P)  # pages per chunk: the temporaries follow a chunk, not the request
        for b, n in enumerate(lens.tolist()):
            start = int(kv_indptr[b])
            for j in range(0, -(-n // P), step):  # chunk of pages j .. j + step
                a, e = j * P, min(n, (j + step) * P)
                rows = (table[b, j : j + step, None] * P + offsets).reshape(-1)  # [<= step * P]
                kv_indices[start + a : start + e] = rows[: e - a]
        return cls.token_index(kv_indptr, kv_indices, query_start_loc)

    @classmethod
    def from_tensors(cls, t: Mapping[str, torch.Tensor]) -> "Attended":
        """:meth:`token_index` of a capture's tensors by name (synthetic and golden inputs, before a
        Capture exists); a decode dict has no qo_indptr."""
        return cls.token_index(t["kv_indptr"], t["kv_indices"], t.get("qo_indptr"), t.get("custom_mask"), t.get("mask_indptr"))

    @classmethod
    def sparse_topk(
        cls,
        indices: torch.Tensor,
        lengths: Optional[torch.Tensor] = None,
        extra_indices: Optional[torch.Tensor] = None,
        extra_lengths: Optional[torch.Tensor] = None,
    ) -> "Attended":
        """DeepSeek's sparse decode (V3.2 DSA: ``indices`` [R, K]; V4: plus the compressed cache's
        ``extra_indices`` [R, K2]): one group per query row, its rows the entries of its list that
        are not -1 and stand before its length ([R]; None: the whole width), main cache first, in
        list order, then the extra cache's (``pool_ids`` 0 / 1 when there is one). A row with no
        entry is an empty group ("lonely": out 0, lse +inf). No causal_len: the set is the visibility.
        """
        scopes = [(indices, lengths, 0)] + ([(extra_indices, extra_lengths, 1)] if extra_indices is not None else [])
        R = indices.shape[0]
        parts, pools, counts = [], [], torch.zeros(R, dtype=torch.long)
        for idx, ln, pool in scopes:
            idx = idx.long().cpu()  # [R, K]
            keep = idx != -1  # [R, K]
            if ln is not None:
                keep &= torch.arange(idx.shape[1])[None, :] < ln.long().cpu()[:, None]
            parts.append((idx, keep))
            pools.append(pool)
            counts += keep.sum(1)
        # per row: its main entries, then its extra entries (a stable sort of (row, scope) keys)
        row_ids = torch.cat([torch.arange(R)[:, None].expand_as(k)[k] for _, k in parts])
        scope_ids = torch.cat([torch.full((int(k.sum()),), i) for i, (_, k) in enumerate(parts)])
        values = torch.cat([i[k] for i, k in parts])
        order = torch.argsort(row_ids * len(parts) + scope_ids, stable=True)
        pool_ids = torch.tensor(pools, dtype=torch.int8)[scope_ids[order]] if len(parts) > 1 else None
        indptr = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)])
        return cls(indptr, values[order], torch.arange(R), pool_ids=pool_ids)

    # ----------------------------------------------------------------------------------------
    # sizes
    # ----------------------------------------------------------------------------------------

    @property
    def num_rows(self) -> int:
        """R: query rows (the rows of ``out``)."""
        return self.group_of_row.shape[0]

    @property
    def num_groups(self) -> int:
        """G: groups (requests in the token-index layout)."""
        return self.indptr.shape[0] - 1

    def lengths(self) -> torch.Tensor:
        """[G] int64: rows each group owns (L_g)."""
        return self.indptr[1:] - self.indptr[:-1]

    def new_tokens(self) -> torch.Tensor:
        """[G] int64: how many of each group's last positions a call brings as new tokens (an extend
        kernel's ``k_extend``): one per query row, at most L_g (decode: 1 per non-empty group)."""
        return torch.minimum(self.query_indptr[1:] - self.query_indptr[:-1], self.lengths())

    def max_length(self) -> int:
        return int(self.lengths().max()) if self.num_groups else 0

    @cached_property
    def query_indptr(self) -> torch.Tensor:
        """[G + 1] int64: group g's query rows are query_indptr[g]:query_indptr[g + 1]."""
        counts = torch.bincount(self.group_of_row, minlength=self.num_groups)  # [G]
        return torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)])

    @property
    def one_query_per_group(self) -> bool:
        """Decode-shaped: query row g reads group g, all of it."""
        return self.num_rows == self.num_groups and self.causal_len is None and self.mask is None and bool(
            torch.equal(self.group_of_row, torch.arange(self.num_rows))
        )

    @property
    def has_mask(self) -> bool:
        return self.mask is not None

    # ----------------------------------------------------------------------------------------
    # what a group owns, what a query row sees
    # ----------------------------------------------------------------------------------------

    def group_rows(self, g: int) -> torch.Tensor:
        """[L_g] int64: the pool rows group g owns, in position order."""
        return self.rows[int(self.indptr[g]) : int(self.indptr[g + 1])]

    def group_pools(self, g: int) -> Optional[torch.Tensor]:
        """[L_g] int8: the pool of each of group g's rows (None: one pool)."""
        if self.pool_ids is None:
            return None
        return self.pool_ids[int(self.indptr[g]) : int(self.indptr[g + 1])]

    def queries(self, g: int) -> range:
        """The query rows that read group g."""
        qi = self.query_indptr
        return range(int(qi[g]), int(qi[g + 1]))

    def visibility(self, g: int) -> torch.Tensor:
        """[n_g, L_g] bool: which of group g's rows each of its query rows sees."""
        L, qs = int(self.indptr[g + 1] - self.indptr[g]), self.queries(g)
        n = len(qs)
        if self.mask is not None:
            start = int(self.mask_indptr[g])
            return self.mask[start : start + n * L].view(n, L)  # [n, L]
        if self.causal_len is not None:
            return torch.arange(L)[None, :] < self.causal_len[qs.start : qs.stop][:, None]  # [n, L]
        return torch.ones(n, L, dtype=torch.bool)  # [n, L]

    def query_positions(self, g: int) -> list[tuple[int, Positions]]:
        """(t, what t sees of the group's rows) for each query row t of group g (see :meth:`positions`)."""
        qs = self.queries(g)
        if self.mask is None:
            return [(t, self.positions(t)) for t in qs]
        vis = self.visibility(g)  # [n, L]
        return [(t, vis[i]) for i, t in enumerate(qs)]

    def extent(self, g: int) -> torch.Tensor:
        """[n_g] int64: per query row of group g, one past the last position it sees (a prefix length:
        its causal_len; under a mask, the last True entry + 1; else L_g). What a hypothesis shifts."""
        vis = self.visibility(g)  # [n, L]
        if self.mask is None:
            return vis.sum(1)
        L = vis.shape[1]
        last = torch.where(vis, torch.arange(1, L + 1)[None, :], torch.zeros_like(vis, dtype=torch.long))
        return last.amax(1) if L else torch.zeros(vis.shape[0], dtype=torch.long)

    def is_bottom_right_causal(self) -> bool:
        """Whether every query row sees exactly its group's prefix up to its own position (query i of
        n sees positions 0..L - n + i): an extend or chain verify, or a tree mask that is a chain."""
        for g in range(self.num_groups):
            vis = self.visibility(g)  # [n, L]
            n, L = vis.shape
            if not torch.equal(vis, torch.arange(L)[None, :] <= (L - n + torch.arange(n))[:, None]):
                return False
        return True

    def positions(self, t: int) -> Positions:
        """What query row t sees of its group's rows: a slice (a prefix, or all) or an [L_g] bool mask.

        ``kv[att.positions(t)]`` on the group's gathered rows [L_g, D] gives the rows t attends."""
        if self.mask is not None:
            g = int(self.group_of_row[t])
            return self.visibility(g)[t - self.queries(g).start]
        if self.causal_len is not None:
            return slice(0, int(self.causal_len[t]))
        return slice(None)

    def rows_seen(self, t: int) -> torch.Tensor:
        """[L_t] int64: the pool rows query row t attends, in position order."""
        return self.group_rows(int(self.group_of_row[t]))[self.positions(t)]

    def seen_counts(self) -> torch.Tensor:
        """[R] int64: how many rows each query row attends."""
        if self.causal_len is not None:
            return self.causal_len.clone()
        if self.mask is not None:
            return torch.cat([self.visibility(g).sum(1) for g in range(self.num_groups)] or [torch.zeros(0, dtype=torch.long)])
        return self.lengths()[self.group_of_row]

    def dense(self, num_pool_rows: int, pool: int = 0) -> torch.Tensor:
        """[R, N] int64: how many times each query row reads each row of ``pool`` (tests, small calls).

        Counts, not bools: a pool row listed twice in a group is attended twice (weight 2)."""
        out = torch.zeros(self.num_rows, num_pool_rows, dtype=torch.long)  # [R, N]
        for g in range(self.num_groups):
            rows, pools, vis = self.group_rows(g), self.group_pools(g), self.visibility(g)  # [L], [L], [n, L]
            if pools is not None:
                rows, vis = rows[pools == pool], vis[:, pools == pool]
            qs = self.queries(g)
            for i, t in enumerate(qs):
                out[t].index_add_(0, rows[vis[i]], torch.ones(int(vis[i].sum()), dtype=torch.long))
        return out

    # ----------------------------------------------------------------------------------------
    # subsets
    # ----------------------------------------------------------------------------------------

    def select(self, groups: list[int]) -> "Attended":
        """The description restricted to some groups (renumbered 0..len-1, their query rows in order)."""
        sel = [int(g) for g in groups]
        lens, qi = self.lengths(), self.query_indptr
        indptr = torch.cat([torch.zeros(1, dtype=torch.long), lens[sel].cumsum(0)]) if sel else torch.zeros(1, dtype=torch.long)
        rows = torch.cat([self.group_rows(g) for g in sel]) if sel else self.rows[:0]
        nq = torch.tensor([int(qi[g + 1] - qi[g]) for g in sel], dtype=torch.long)
        group_of_row = torch.repeat_interleave(torch.arange(len(sel)), nq)
        trows = [t for g in sel for t in self.queries(g)]
        pool_ids = torch.cat([self.group_pools(g) for g in sel]) if self.pool_ids is not None and sel else None
        causal_len = self.causal_len[trows] if self.causal_len is not None else None
        mask = mask_indptr = None
        if self.mask is not None:
            blocks = [self.visibility(g).reshape(-1) for g in sel]
            mask = torch.cat(blocks) if blocks else self.mask[:0]
            mask_indptr = torch.cat([torch.zeros(1, dtype=torch.long), torch.tensor([b.numel() for b in blocks], dtype=torch.long).cumsum(0)])
        return Attended(indptr, rows, group_of_row, causal_len, mask, mask_indptr, pool_ids)

    def query_rows_of(self, groups: list[int]) -> list[int]:
        """The query rows of the given groups, in order (to slice q / out alongside :meth:`select`)."""
        return [t for g in groups for t in self.queries(int(g))]


def tree_visibility(L: int, parents: Sequence[int]) -> torch.Tensor:
    """[n, L] bool: one request's draft tree in SGLang's custom_mask layout (the n drafts are the last n
    of L positions; ``parents[i]`` is draft i's parent draft, -1 for a root): the prefix all True,
    draft i sees its ancestors and itself."""
    n = len(parents)
    m = torch.zeros(n, L, dtype=torch.bool)  # [n, L]
    m[:, : L - n] = True
    for i in range(n):
        j = i
        while j >= 0:
            m[i, L - n + j] = True
            j = parents[j]
    return m


__all__ = ["Attended", "Positions", "tree_visibility"]
