"""tools/flashmla_peer.py: FlashMLA's own torch reference for sparse decode (tests/ref.py::
ref_sparse_attn_decode), loaded at run time from a checkout, as a sparse kernel the sweep runs
(``flashmla_peer_ref``, tests/sweep_standins.py).

Without a checkout the loader is tested on a file this test writes in the real file's shape (its
module-level import of FlashMLA's test library, the library's types as annotations, a nested
function, a prefill reference beside it): that file's body is written here and checks only the
loading and the call's plumbing. The claim "a correct kernel not written here passes a sweep" is
the last test's, on the real tests/ref.py of the checkout ``$REFMLA_FLASHMLA_REPO`` names (skipped
without one)."""

from __future__ import annotations

import os

import pytest

import sweep_standins
from helpers import load_tool
from refmla.sparse.backends import BACKENDS
from refmla.sweep import SweepConfig, run_sweep

peer_mod = load_tool("flashmla_peer")

SHAPE = '''
from typing import Optional, Tuple

import torch

from lib import TestParam, Testcase, TestcaseForDecode, KVScope

raise SystemExit("the module's own code ran")


def ref_sparse_attn_fwd(p: TestParam, t: Testcase) -> Tuple[torch.Tensor, torch.Tensor]:
    raise AssertionError("the prefill reference is not the decode's")


def ref_sparse_attn_decode(p: TestParam, t: TestcaseForDecode) -> Tuple[torch.Tensor, torch.Tensor]:
    b = p.decode.b

    def one_scope(kv_scope: KVScope) -> Tuple[torch.Tensor, torch.Tensor]:
        topk = kv_scope.indices_in_kvcache.size(-1)
        rows = kv_scope.blocked_k.view(-1, p.d_qk).index_select(0, kv_scope.indices_in_kvcache.clamp_min(0).view(-1))
        invalid = kv_scope.indices_in_kvcache == -1
        if kv_scope.topk_length is not None:
            invalid |= torch.arange(topk).view(1, 1, topk) >= kv_scope.topk_length.view(b, 1, 1)
        return rows.view(b, p.s_q, topk, p.d_qk), invalid

    kv, invalid = one_scope(t.kv_scope)
    if t.extra_kv_scope is not None:
        kv1, invalid1 = one_scope(t.extra_kv_scope)
        kv, invalid = torch.cat([kv, kv1], dim=2), torch.cat([invalid, invalid1], dim=2)
    kv = kv.view(b * p.s_q, -1, p.d_qk).float().nan_to_num(0.0)
    s = (t.q.float().view(b * p.s_q, p.h_q, p.d_qk) @ kv.transpose(-1, -2)) * t.sm_scale
    s[invalid.view(b * p.s_q, 1, -1).expand_as(s)] = float("-inf")
    lse = s.logsumexp(dim=-1)
    out = (torch.exp(s - lse.unsqueeze(-1)) @ kv[..., : p.d_v]).view(b, p.s_q, p.h_q, p.d_v)
    lse = lse.view(b, p.s_q, p.h_q)
    if t.attn_sink is not None:
        out *= (1.0 / (1.0 + torch.exp(t.attn_sink.view(1, 1, p.h_q) - lse))).unsqueeze(-1)
    lonely = lse == float("-inf")
    out[lonely.unsqueeze(-1).expand_as(out)] = 0.0
    lse[lonely] = float("+inf")
    return out.to(torch.bfloat16), lse.transpose(1, 2)
'''
DROPS_EXTRA = SHAPE.replace("if t.extra_kv_scope is not None:", "if False:")  # the compressed scope never read
SPACE = ["heads=16", "batch=1,3", "length=0,65,width+1", "topk=64,128", "page=64", "sink=on,large",
         "topk_length=given,none"]  # fmt: skip


def _checkout(tmp_path, body: str):
    (tmp_path / "tests").mkdir(parents=True, exist_ok=True)
    (tmp_path / "tests" / "ref.py").write_text(body)
    return tmp_path


def _sweep(tmp_path, monkeypatch, repo, cases: int):
    monkeypatch.setenv(peer_mod.ENV, str(repo))
    monkeypatch.setitem(BACKENDS, sweep_standins.FLASHMLA_PEER, sweep_standins.flashmla_peer_path)
    return run_sweep(SweepConfig(backends=[sweep_standins.FLASHMLA_PEER], budget=600, out=str(tmp_path / "out"),
                                 max_cases=cases, layouts=["sparse"], space=SPACE, repeat=2, max_shrink=0))  # fmt: skip


def test_only_the_decode_reference_is_loaded_without_its_library(tmp_path):
    peer = peer_mod.load_flashmla_peer(_checkout(tmp_path, SHAPE))
    assert peer.functions == ("ref_sparse_attn_decode",) and peer.path == tmp_path / "tests" / "ref.py"


def test_a_file_that_cannot_give_the_reference_is_refused_in_one_line(tmp_path):
    with pytest.raises(peer_mod.FlashMLAPeerError, match="no such file"):
        peer_mod.load_flashmla_peer(tmp_path / "nowhere")
    with pytest.raises(peer_mod.FlashMLAPeerError, match="no module-level function ref_sparse_attn_decode"):
        peer_mod.load_flashmla_peer(_checkout(tmp_path, "import torch\n"))
    needs_lib = SHAPE.replace("    b = p.decode.b\n", "    b = p.decode.b\n    KVScope.check(t)\n")
    with pytest.raises(peer_mod.FlashMLAPeerError, match="needs KVScope, which comes from lib"):
        peer_mod.load_flashmla_peer(_checkout(tmp_path, needs_lib))
    unbound = SHAPE.replace("    b = p.decode.b\n", "    b = p.decode.b\n    check_shapes(t)\n")
    with pytest.raises(peer_mod.FlashMLAPeerError, match="uses check_shapes, which the file does not bind"):
        peer_mod.load_flashmla_peer(_checkout(tmp_path, unbound))


def test_the_calls_plumbing_both_caches_and_a_reference_that_drops_one_is_found(tmp_path, monkeypatch):
    """The file in ref.py's shape, through the adapter (refmla's dequantized caches, indices,
    topk_length, V4's extra cache, the sink, lse [B, H, S] back to [B, S, H]): every case passes;
    the same file ignoring the extra cache fails the reference check on a V4 point with a
    compressed scope, so the plumbing is what is being tested."""
    rep = _sweep(tmp_path, monkeypatch, _checkout(tmp_path / "good", SHAPE), 6)
    counts = rep.backends[sweep_standins.FLASHMLA_PEER].counts
    assert rep.exit_code == 0 and counts["reference"] == {"pass": 6} and counts["repeat"] == {"pass": 6}, counts
    bad = _sweep(tmp_path, monkeypatch, _checkout(tmp_path / "bad", DROPS_EXTRA), 6)
    failed = {c.point["cache"] for c in bad.cases if c.outcomes[sweep_standins.FLASHMLA_PEER]["reference"].failed}
    assert bad.exit_code == 1 and failed and failed <= {"v4-c4", "v4-c128"}, failed


@pytest.mark.skipif(not os.environ.get(peer_mod.ENV), reason=f"no FlashMLA checkout (set {peer_mod.ENV})")
def test_flashmlas_own_reference_passes_a_sparse_sweep(tmp_path, monkeypatch):
    """FlashMLA's tests/ref.py (code not written here) as a sparse kernel: V3.2 and every V4 cache,
    empty and width-edge contexts, sinks, topk_length given or not: no false alarm."""
    repo = os.environ[peer_mod.ENV]
    peer = peer_mod.load_flashmla_peer(repo)
    assert "ref_sparse_attn_decode" in peer.functions
    rep = _sweep(tmp_path, monkeypatch, repo, 8)
    counts = rep.backends[sweep_standins.FLASHMLA_PEER].counts
    assert rep.exit_code == 0 and counts["reference"] == {"pass": 8} and counts["repeat"] == {"pass": 8}, counts
    assert {c.point["cache"] for c in rep.cases} == {"v4-c4", "v4-c128", "v4-swa", "v32"}

