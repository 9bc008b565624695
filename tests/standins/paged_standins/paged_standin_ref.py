"""Shared by the block-table kernel stand-ins (tests only, not kernels): argument checks that
raise ContractViolation naming the first broken convention, and the documented result computed
with refmla's fp64 reference over the block table the stand-in was given."""

from __future__ import annotations

import torch

from refmla import blocktable
from refmla.attended import Attended
from refmla.reference import mla_decode_ref
from refmla.scales import Scales

CALLS: list[dict] = []  # one record per stand-in call, newest last


class ContractViolation(AssertionError):
    """The caller broke the kernel's documented argument convention."""


def need(ok: bool, what: str) -> None:
    if not ok:
        raise ContractViolation(what)


def int32_table(name: str, t, rows: int) -> None:
    need(isinstance(t, torch.Tensor) and t.dtype == torch.int32, f"{name} must be an int32 tensor")
    need(t.dim() == 2 and t.shape[0] == rows, f"{name} must be [{rows}, max_blocks], got {list(t.shape)}")
    need(t.is_contiguous(), f"{name} must be contiguous")


def int32_lens(name: str, t, rows: int) -> None:
    need(isinstance(t, torch.Tensor) and t.dtype == torch.int32, f"{name} must be an int32 tensor")
    need(t.shape == (rows,), f"{name} must be [{rows}], got {list(t.shape)}")


def attend(q: torch.Tensor, pool: torch.Tensor, table: torch.Tensor, seq_lens: torch.Tensor, sm_scale: float):
    """out [B, H, 512] (q's dtype), lse [B, H] fp32 of q [B, H, 576] over pool [pages, P, 576]."""
    P = pool.shape[1]
    need(bool((table.long() < pool.shape[0]).all()), "a block_table entry is past the pool")
    indptr, rows = blocktable.token_rows(table.cpu(), seq_lens.cpu(), P)
    att, sc = Attended.token_index(indptr, rows), Scales(kv_lora_rank=512, sm_scale=float(sm_scale))
    out, lse = mla_decode_ref(q.cpu(), pool.reshape(-1, 1, pool.shape[-1]).cpu(), att, sc)
    return out.to(q.dtype), lse.float()
