"""The local torch extend holds a request's prefix whole: past its budget it is skipped with the figure,
never asked for gigabytes (issue 22: indices that all name one row of a one-row pool)."""

from __future__ import annotations

import torch

from refmla.backends.extend import as_extend, local
from refmla.capture import read_capture, write_capture
from refmla.context import ReplayOptions
from refmla.pipeline import replay_capture


def _one_row_pool(path, L: int, H: int = 4):
    g = torch.Generator().manual_seed(0)
    pool = torch.randn(1, 1, 576, generator=g).to(torch.bfloat16)  # a one-row pool
    q = torch.randn(1, H, 576, generator=g).to(torch.bfloat16)
    t = dict(q=q, kv_buffer=pool, kv_indptr=torch.tensor([0, L], dtype=torch.int32),
             kv_indices=torch.zeros(L, dtype=torch.int32), seq_lens=torch.tensor([L], dtype=torch.int32),
             out=pool[0, 0, :512].expand(1, H, 512).contiguous())  # every row equal: out = v exactly
    meta = dict(mode="decode", backend="triton", kv_lora_rank=512, qk_rope_head_dim=64, sm_scale=0.1,
                logit_cap=0.0, page_size=1)
    write_capture(path, t, meta)
    return read_capture(path)


def test_over_its_budget_the_local_extend_is_skipped_with_the_figure(tmp_path, monkeypatch):
    cap = _one_row_pool(tmp_path / "c.safetensors", 4096)
    need, b = local.working_set(as_extend(cap), cap.kv_buffer)
    monkeypatch.setattr(local, "LOCAL_EXTEND_BUDGET", need - 1)
    rep = replay_capture(cap, ReplayOptions(backends=["extend"], explain=False))
    entry = rep.backends["extend"]
    assert entry.status == "skipped" and "past its budget" in entry.reason and "request 0" in entry.reason
    assert rep.verdict == "agree" and rep.backends["observed"].status == "pass"  # the others still judge it


def test_within_its_budget_the_local_extend_runs(tmp_path, monkeypatch):
    cap = _one_row_pool(tmp_path / "c.safetensors", 4096)
    need, _ = local.working_set(as_extend(cap), cap.kv_buffer)
    monkeypatch.setattr(local, "LOCAL_EXTEND_BUDGET", need)
    monkeypatch.setenv("REFMLA_EXTEND_IMPL", "torch")
    rep = replay_capture(cap, ReplayOptions(backends=["extend"], explain=False))
    assert rep.backends["extend"].status == "pass"

