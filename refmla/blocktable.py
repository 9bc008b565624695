"""Block tables: the page-level layout vLLM and the NVIDIA MLA kernels read, and its consistency.

A block table ``block_table [B, M]`` lists request b's pages in position order; with page size P,
position j of request b lives in pool row ``block_table[b, j // P] * P + j % P`` of a pool of
``N`` rows (``N // P`` pages). Entries past ``ceil(L_b / P)`` are padding (vLLM pads with its null
block 0, FlashInfer and SGLang with 0 or -1) and are never read by a correct kernel.

    token_rows(...)        block table -> SGLang's (kv_indptr, kv_indices) token slots
    from_token_rows(...)   kv_indptr / kv_indices -> a page-size-1 block table (vLLM's aiter path)
    problems(...)          one line per inconsistency: a page past the pool, a row shorter than
                           its seq_len, -1 entries inside a sequence
    null_block_reads(...)  one line per request that reads the engine's null block
    compact_pages(...)     the pages a capture needs, renumbered (the writer's compaction)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from refmla.attended import Attended
from refmla.util import cdiv, request_label

MAX_LINES = 16  # inconsistency lines listed before "... and N more"
# The positions a block table may expand to (the sum of seq_lens), at most (docs/contract.md
# section 1, "Bounds"). A token-slot capture's kv_indices are bounded by its file; a table's
# positions are not (one entry names a page of up to 65,536 rows), so its expansion is bounded here:
# the token rows are int64 [positions], 128 MiB at the bound.
MAX_POSITIONS = 1 << 24


def token_rows(block_table: torch.Tensor, seq_lens: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(kv_indptr [B + 1] int32, kv_indices [sum L] int64): position j of request b is row
    block_table[b, j // P] * P + j % P (:meth:`refmla.attended.Attended.block_table`). The table
    must cover every sequence (see :func:`problems`)."""
    att = Attended.block_table(block_table, seq_lens, page_size)
    return att.indptr.to(torch.int32), att.rows


def from_token_rows(kv_indptr: torch.Tensor, kv_indices: torch.Tensor, pad: int = 0) -> torch.Tensor:
    """[B, max(L)] int32 page-size-1 block table of SGLang token slots (padding ``pad``): the
    layout vLLM's ROCM_AITER_MLA builds (kernel block size 1), and what a block-table kernel
    reads a token-slot capture through."""
    lens = (kv_indptr[1:] - kv_indptr[:-1]).long().cpu()  # [B]
    M = max(int(lens.max()) if lens.numel() else 0, 1)
    table = torch.full((lens.shape[0], M), int(pad), dtype=torch.int32)
    for b, n in enumerate(lens.tolist()):
        start = int(kv_indptr[b])
        table[b, :n] = kv_indices[start : start + n].to(torch.int32).cpu()
    return table


@dataclass(frozen=True)
class Problems:
    """What :func:`problems` found: one line per inconsistency (the rows cannot be read)."""

    errors: list
    over_bound: bool = False  # the table's positions pass MAX_POSITIONS: its one line, nothing else looked at

    def text(self, lines: list) -> str:
        if self.over_bound:
            return lines[0]
        more = len(lines) - MAX_LINES
        shown = lines[:MAX_LINES] + ([f"... and {more} more"] if more > 0 else [])
        # one clause per inconsistency, on the one line a bad input gets (docs/contract.md section 3)
        return f"{len(lines)} inconsistenc{'y' if len(lines) == 1 else 'ies'}: " + "; ".join(shown)


def problems(block_table: torch.Tensor, seq_lens: torch.Tensor, page_size: int, pool_rows: int) -> Problems:
    """One line per inconsistency of a block table with its sequences and pool: positions past
    MAX_POSITIONS (alone: nothing else is looked at), a row shorter than its seq_len (M * P < L_b),
    a page past the pool (>= N // P), -1 or any negative entry inside a sequence (the null block is
    :func:`null_block_reads`)."""
    P, pages = int(page_size), int(pool_rows) // int(page_size)
    total = sum(max(0, n) for n in seq_lens.long().cpu().tolist())  # Python ints: never wraps
    if total > MAX_POSITIONS:  # before any per-position work
        return Problems([f"seq_lens add up to {total:,} positions, past the bound of {MAX_POSITIONS:,} positions "
                         "a block table may expand to (docs/contract.md section 1, Bounds)"], over_bound=True)  # fmt: skip
    table = block_table.long().cpu()  # [B, M]
    errors = []
    for b, L in enumerate(seq_lens.long().cpu().tolist()):
        need = cdiv(L, P)  # pages request b reads
        who = request_label(b)
        if need > table.shape[1]:
            errors.append(f"{who}: block_table row has {table.shape[1]} pages ({table.shape[1] * P} positions) "
                          f"but seq_len {L} needs {need}")  # fmt: skip
        row = table[b, : min(need, table.shape[1])]  # [need]
        for j in torch.nonzero(row < 0).flatten().tolist():
            errors.append(f"{who}: block_table[{b}, {j}]={int(row[j])} inside the sequence (positions {j * P}..)")
        for j in torch.nonzero(row >= pages).flatten().tolist():
            errors.append(f"{who}: block_table[{b}, {j}]={int(row[j])} is past the pool ({pages} pages of {P})")
    return Problems(errors)


def null_block_reads(
    kv_indptr: torch.Tensor, physical_rows: torch.Tensor, page_size: int, null_block: int
) -> list[str]:
    """One line per request whose sequence reads the engine's null block (vLLM #39444: block 0
    holds whatever was written to it). ``physical_rows``: the production pool rows of every
    position (a capture's orig_kv_indices, else its kv_indices), so compaction cannot hide it."""
    hits = (physical_rows.long().cpu() // int(page_size)) == int(null_block)  # [nnz]
    lines = []
    for b in range(kv_indptr.shape[0] - 1):
        a, e = int(kv_indptr[b]), int(kv_indptr[b + 1])
        where = torch.nonzero(hits[a:e]).flatten()
        if where.numel():
            lines.append(f"{request_label(b)}: {where.numel()} positions (first {int(where[0])}) are in the null "
                         f"block {null_block}")  # fmt: skip
    return lines


def compact_pages(block_table: torch.Tensor, page_size: int, pool_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(pages kept [K] sorted, block_table renumbered to them): every in-pool page of the table,
    padding included (a kernel that reads past a sequence reads those; vLLM pads with the null
    block, so this keeps one page more). Entries outside the pool become -1."""
    pages = int(pool_rows) // int(page_size)
    table = block_table.long().cpu()  # [B, M]
    inside = (table >= 0) & (table < pages)
    kept = torch.unique(table[inside])  # [K]
    renumbered = torch.searchsorted(kept, table.clamp(min=0))
    return kept, torch.where(inside, renumbered, -1).to(block_table.dtype)


__all__ = ["MAX_LINES", "MAX_POSITIONS", "Problems", "compact_pages", "from_token_rows", "null_block_reads", "problems",
           "token_rows"]  # fmt: skip
