"""The SGLang hook under decode context parallelism: each rank's Triton forward_decode (a stand-in of
SGLang 0.5.23's DCP branch, tests/standins/sglang_triton_dcp.py, running SGLang's real decode kernel
and its real cp_lse_ag_out_rs_mha) is captured as a rank capture, the pre-merge partial and the
combine's output included, and the ranks' captures replay as one call."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from refmla.backends.cpu_compat import torchvision_cpu_shim
from refmla.backends.triton_interp import ensure_interpreter, install_bf16_dot_fix
from refmla.capture import read_capture
from refmla.cp.judge import replay_step
from refmla.hook import patching
from refmla.hook.config import HookConfig

torchvision_cpu_shim()
STANDINS = Path(__file__).resolve().parent / "standins"
W, H, D, DV = 2, 8, 576, 512  # DCP 2; Kimi-K2 over TP8: 8 heads per rank, 16 gathered
SEQ = (70, 9, 3)  # rank 1 holds one position of the last request
SCALE = 192**-0.5 * (0.1 * math.log(32.0) + 1.0) ** 2


@pytest.fixture
def standin(monkeypatch):
    ensure_interpreter()
    install_bf16_dot_fix()  # the interpreter's bf16 dot, as every test of a Triton kernel here
    monkeypatch.syspath_prepend(str(STANDINS))
    try:
        import sglang_triton_dcp
    except Exception as e:  # SGLang's kernel or DCP module not importable here
        pytest.skip(f"SGLang's Triton decode / DCP combine not importable: {type(e).__name__}: {e}")
    monkeypatch.setitem(sys.modules, "sglang.srt.layers.attention.triton_backend", sglang_triton_dcp)
    yield sglang_triton_dcp
    patching.uninstall()


class Group:
    """The DCP group in one process: all_gather of q (dim 1) hands back every rank's heads, of the
    lse (dim 0) every rank's lse; all_reduce sums every rank's scaled partial (SGLang's scaling,
    written out here) in fp32, rank by rank."""

    def __init__(self, rank, q_all, partials):
        self.world_size, self.rank_in_group, self.q_all, self.partials = W, rank, q_all, partials

    def all_gather(self, t, dim=0):
        if dim == 1:
            assert torch.equal(t, self.q_all[:, self.rank_in_group * H : (self.rank_in_group + 1) * H])
            return self.q_all.clone()
        if not self.partials:  # the first pass: nothing from the others yet
            return torch.cat([t] * W, 0)
        return torch.cat([t if r == self.rank_in_group else self.partials[r][1] for r in range(W)], 0)

    def all_reduce(self, out):
        if not self.partials:
            return out
        lses = torch.stack([p[1] for p in self.partials])
        total = torch.logsumexp(lses, 0)
        acc = torch.zeros_like(out)
        for r, (o, lse) in enumerate(self.partials):
            scale = torch.exp(lse - total).unsqueeze(-1).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
            acc += out if r == self.rank_in_group else o.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0) * scale
        return acc


def _step(seed=0):
    """The whole KV, q, and per rank its pool and kernel indices laid out as SGLang's DCP does it:
    position p on rank p % W, its global slot s (s % W == p % W) at the rank's row s // W, the
    kernel reading req_to_token[b, r + j W] // W for its j-th local position."""
    g = torch.Generator().manual_seed(seed)
    whole = [torch.randn(L, D, generator=g).to(torch.bfloat16) for L in SEQ]
    q = (torch.randn(len(SEQ), W * H, D, generator=g) * 0.5).to(torch.bfloat16)
    blocks = [-(-L // W) for L in SEQ]
    perm = torch.randperm(sum(blocks) + 2, generator=g) + 1
    slots, used = [], 0
    for L, n in zip(SEQ, blocks):
        slots.append([int(perm[used + p // W]) * W + p % W for p in range(L)])
        used += n
    rows = (int(perm.max()) + 2) * 1
    ranks = []
    for r in range(W):
        pool = torch.full((rows, 1, D), float("nan"), dtype=torch.bfloat16)
        indptr, idx = [0], []
        for b, L in enumerate(SEQ):
            for p in range(r, L, W):
                pool[slots[b][p] // W, 0] = whole[b][p]
                idx.append(slots[b][p] // W)
            indptr.append(len(idx))
        ranks.append((pool, torch.tensor(indptr, dtype=torch.int64), torch.tensor(idx, dtype=torch.int64)))
    return q, ranks


def _backend(mod, r, q_all, ranks, partials):
    pool, indptr, idx = ranks[r]
    S = 4
    md = SimpleNamespace(kv_indptr=indptr, kv_indices=idx, num_kv_splits=torch.full((len(SEQ),), S, dtype=torch.int32),
                         attn_logits=torch.empty(len(SEQ), W * H, S, DV), attn_lse=torch.empty(len(SEQ), W * H, S))  # fmt: skip
    kv = SimpleNamespace(get_key_buffer=lambda i: pool, get_value_buffer=lambda i: pool[..., :DV], kv_lora_rank=DV)
    return mod.TritonAttnBackend(kv, md, W, r, Group(r, q_all, partials), S)


def _layer():
    return SimpleNamespace(layer_id=3, tp_q_head_num=H, tp_k_head_num=1, qk_head_dim=D, head_dim=D, v_head_dim=DV,
                           scaling=SCALE, logit_cap=0.0, sliding_window_size=-1, k_scale=None, v_scale=None,
                           k_scale_float=None, v_scale_float=None, xai_temperature_len=-1)  # fmt: skip


def _batch():
    seq = torch.tensor(SEQ, dtype=torch.int64)
    return SimpleNamespace(batch_size=len(SEQ), seq_lens=seq, seq_lens_cpu=seq, forward_mode=SimpleNamespace(name="DECODE"),
                           req_pool_indices=None, spec_info=None)  # fmt: skip


def test_each_rank_is_captured_with_its_partial_and_the_combine(standin, tmp_path):
    q_all, ranks = _step()
    layer, fb = _layer(), _batch()
    partials = []
    for r in range(W):  # the ranks' partials (each rank's kernel over its shard), unhooked
        be = _backend(standin, r, q_all, ranks, [])
        be.forward_decode(q=q_all[:, r * H : (r + 1) * H].reshape(len(SEQ), -1), k=None, v=None, layer=layer, forward_batch=fb)
        partials.append(be.last_partial)
    folder = tmp_path / "step"
    for r in range(W):
        args = dict(q=q_all[:, r * H : (r + 1) * H].reshape(len(SEQ), -1), k=None, v=None, layer=layer, forward_batch=fb)
        plain = _backend(standin, r, q_all, ranks, partials).forward_decode(**args)
        patching.install(HookConfig(out_dir=str(folder), min_seq_len=1, backends=frozenset({"triton"})))
        try:
            served = _backend(standin, r, q_all, ranks, partials).forward_decode(**args)
            state = patching.current_state().summary()
        finally:
            patching.uninstall()
        assert torch.equal(plain, served)  # the server's output, untouched
        assert state["disabled"] is None and state["files_written"] == 1, state
    caps = {c.meta.dcp_rank: c for c in map(read_capture, sorted(folder.glob("*.safetensors")))}
    assert sorted(caps) == list(range(W))
    for r, cap in caps.items():
        m = cap.meta
        assert (m.dcp_world_size, m.dcp_interleave_size, m.dcp_tot_seq_lens) == (W, 1, list(SEQ))
        assert m.extra["dcp_combine"] == "cp_lse_ag_out_rs_mha" and m.extra["dcp_source"] == "sglang_pre_merge"
        assert f"dcp{r}of{W}" in Path(cap.path).name
        assert torch.equal(cap.q, q_all)  # the gathered heads the kernel got, not forward_decode's own
        assert torch.equal(cap.out, partials[r][0]) and torch.equal(cap.lse, partials[r][1])  # the pre-merge partial
        assert cap.seq_lens.tolist() == [len(range(r, L, W)) for L in SEQ]
        assert cap.dcp_out.shape == (len(SEQ), H, DV)
    report = replay_step(folder)
    assert report.verdict == "agree", report.text()
    assert [e.status for e in report.ranks] == ["pass"] * W and report.combine.status == "pass"
    assert "whole-context reference: pass" in report.combine.note


def test_a_rank_handed_a_short_local_length_is_named(standin, tmp_path):
    """Rank 0's metadata hands its kernel one row fewer of request 0 (its last local position): the
    step names cp_local_length on rank 0, request 0, at that position, and nothing else."""
    q_all, ranks = _step()
    pool, indptr, idx = ranks[0]
    n0 = int(indptr[1])
    ranks[0] = (pool, torch.cat([indptr[:1], indptr[1:] - 1]), torch.cat([idx[: n0 - 1], idx[n0:]]))
    layer, fb = _layer(), _batch()
    partials = []
    for r in range(W):
        be = _backend(standin, r, q_all, ranks, [])
        be.forward_decode(q=q_all[:, r * H : (r + 1) * H].reshape(len(SEQ), -1), k=None, v=None, layer=layer, forward_batch=fb)
        partials.append(be.last_partial)
    folder = tmp_path / "step"
    for r in range(W):
        patching.install(HookConfig(out_dir=str(folder), min_seq_len=1, backends=frozenset({"triton"})))
        try:
            be = _backend(standin, r, q_all, ranks, partials)
            be.forward_decode(q=q_all[:, r * H : (r + 1) * H].reshape(len(SEQ), -1), k=None, v=None, layer=layer, forward_batch=fb)
        finally:
            patching.uninstall()
    report = replay_step(folder)
    last = 2 * (n0 - 1)  # rank 0's last position of request 0 (positions 0, 2, 4, ...)
    assert [(f.hypothesis, f.rank, f.request, f.positions) for f in report.findings] == [
        ("cp_local_length", 0, 0, [[last, last + 1]])], report.text()
    assert report.verdict == "diverged" and report.exit_code == 1
