"""The ``block_table`` layout's case: vLLM's paged decode, its pool and block table laid out here.

    TableCase (a decode GoldenCase, plus its table's order and its null block) --table_inputs-->
        q [B, H, 576], kv_buffer [pages * P, 1, 576], block_table [B, M] int32, kv_indptr /
        kv_indices (the table's token rows, refmla.blocktable), seq_lens, num_kv_splits [B]

As vLLM lays a decode batch out: page 0 is the null block and every table entry past a sequence's
pages points at it (two spare columns past the longest sequence); the pages a request owns are
handed out shuffled among the pool's (``table`` "shuffled"), in order ("ordered"), or, with prefix
caching, every later request reuses request 0's leading full pages for its own first positions
("shared", the same physical rows). The null block holds NaN ("nan": a read a kernel cancels by
arithmetic still shows) or finite stale rows four times the data's scale ("stale": what vLLM's
block 0 holds in production, vLLM #39444: a read is a wrong value). The tail of each last page
and two free pages are NaN. Inputs are the golden suite's exact-grid values
(refmla.golden.determinism), so a case is the same bytes on every run.

One split count for the whole batch, on vLLM's uniform schedule (meta ``split_schedule``
"uniform": split s of request b attends [s * ceil(L_b / S), ...)), as TRITON_MLA takes its
constexpr ``num_kv_splits``; an fp8 pool has one scale for K and V (forward_mqa passes k_scale
for both).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from refmla import blocktable
from refmla.compare import Tolerance
from refmla.golden.build import KV_LORA_RANK, QK_ROPE_HEAD_DIM, decode_meta
from refmla.golden.cases import GoldenCase
from refmla.golden.determinism import DTYPES, grid_normal, nan_filled, shuffled
from refmla.sweep.space import NULLS, TABLES

NULL_BLOCK = 0  # vLLM's null block
PAD_COLUMNS = 2  # table entries past the longest sequence's pages (the null block)


@dataclass
class TableCase(GoldenCase):
    table: str = "shuffled"  # one of TABLES: how the pages are handed out
    null: str = "nan"  # one of NULLS: what the null block holds

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.table not in TABLES or self.null not in NULLS:
            raise ValueError(f"{self.name}: table {self.table!r} / null {self.null!r}; choose from {TABLES} / {NULLS}")
        if self.mode != "decode" or min(self.seq_lens, default=1) < 1:
            raise ValueError(f"{self.name}: a block-table case is a decode batch of requests of >= 1 token")


def shared_pages(case: TableCase) -> list[int]:
    """Per request, how many of its leading pages are request 0's (``table`` "shared": request 0's
    full pages, never a request's own last page)."""
    P, lens = case.page_size, case.seq_lens
    if case.table != "shared":
        return [0] * len(lens)
    return [0] + [min(lens[0] // P, (L - 1) // P) for L in lens[1:]]


def block_table(case: TableCase) -> tuple[torch.Tensor, int]:
    """(block_table [B, max pages + PAD_COLUMNS] int32, the pool's pages): page 0 the null block."""
    P, lens = case.page_size, case.seq_lens
    need = [-(-L // P) for L in lens]
    shared = shared_pages(case)
    own = sum(n - s for n, s in zip(need, shared))
    n_pages = 1 + own + case.free_pages
    ids = torch.arange(1, n_pages) if case.table == "ordered" else shuffled(case.seed, "pages", n_pages - 1) + 1
    table = torch.full((len(lens), max(need) + PAD_COLUMNS), NULL_BLOCK, dtype=torch.int32)
    used = 0
    for b, (n, s) in enumerate(zip(need, shared)):
        table[b, :s] = table[0, :s]
        table[b, s:n] = ids[used : used + n - s].to(torch.int32)
        used += n - s
    return table, n_pages


def table_inputs(case: TableCase) -> dict[str, torch.Tensor]:
    """The capture tensors of a block-table case (module docstring)."""
    P, D = case.page_size, KV_LORA_RANK + QK_ROPE_HEAD_DIM
    B, H, kv_dtype = len(case.seq_lens), case.num_heads, DTYPES[case.kv_dtype or case.dtype]
    table, n_pages = block_table(case)
    seq = torch.tensor(case.seq_lens, dtype=torch.int32)
    kv_indptr, kv_indices = blocktable.token_rows(table, seq, P)  # [B + 1], [sum L]
    values = grid_normal(case.seed, "kv", (int(kv_indptr[-1]), D), kv_dtype)  # [sum L, D] position order
    pool = nan_filled((n_pages * P, 1, D), kv_dtype)  # [N, 1, D]
    for b, s in enumerate(shared_pages(case)):  # a shared page's rows are request 0's: written once
        lo, hi = int(kv_indptr[b]) + s * P, int(kv_indptr[b + 1])
        pool[kv_indices[lo:hi], 0] = values[lo:hi]
    if case.null == "stale":
        pool[NULL_BLOCK * P : NULL_BLOCK * P + P] = grid_normal(case.seed, "null", (P, 1, D), kv_dtype, 2)
    return {
        "q": grid_normal(case.seed, "q", (B, H, D), DTYPES[case.dtype], case.q_scale_exp),  # [B, H, D]
        "kv_buffer": pool, "block_table": table, "kv_indptr": kv_indptr, "kv_indices": kv_indices,
        "seq_lens": seq, "num_kv_splits": torch.tensor(case.splits, dtype=torch.int32),
    }  # fmt: skip


def table_meta(case: TableCase, tol: Tolerance = Tolerance()) -> dict[str, Any]:
    """The capture meta of a block-table case: decode's, on vLLM's uniform split schedule, with its null block."""
    return {**decode_meta(case, tol), "split_schedule": "uniform", "null_block": NULL_BLOCK}


__all__ = ["NULL_BLOCK", "TableCase", "block_table", "shared_pages", "table_inputs", "table_meta"]
