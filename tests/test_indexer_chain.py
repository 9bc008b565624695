"""A sparse decode capture replayed with its indexer capture beside it: the index set the decode read
is judged too. The decode (V3.2, SGLang's page table shared by the MLA cache and the indexer's key
cache) is built by refmla's sparse synth and its production loop (refmla.sparse.faults, not the
code measured here); the indexer's call by SGLang's own indexer code (tests/indexer_kit.py); the
stale indices are planted by the test."""

from __future__ import annotations

import torch

import indexer_kit as kit
from refmla.compare import Tolerance
from refmla.context import ReplayOptions
from refmla.replay import replay_file
from refmla.sparse.faults import planted_output
from refmla.sparse.presets import sparse_preset
from refmla.sparse.synth import SparseCase, _paged_pool
from refmla.sparse.validation import write_sparse

SEQ = [300, 1100, 2600]
K = 512


def pair(folder, fault="none"):
    """Write decode.safetensors and indexer.safetensors of one call; the decode read what the indexer produced."""
    p = sparse_preset("deepseek-v3.2-tp8")
    g = torch.Generator().manual_seed(3)
    pool, tokens = _paged_pool(SEQ, "v32", 64, g)
    P = pool.pages.shape[0]
    M = max(-(-n // 64) for n in SEQ) + 1
    table = torch.full((len(SEQ), M), -1, dtype=torch.int32)
    for b, tok in enumerate(tokens):
        pg = (tok[::64] // 64).int()
        table[b, : len(pg)] = pg
    itensors, imeta = kit.call(SEQ, topk=K, seed=5, kind="slots", fault=fault, pages=(table, P))
    slots = itensors["indices"]  # [B, K] the MLA cache's tokens (one page table for both caches)
    lens = (slots != -1).sum(1).int()
    case = SparseCase(preset=p, q=torch.randn(len(SEQ), 1, p.heads, 576, generator=g).to(torch.bfloat16), main=pool,
                      indices=slots[:, None].int(), topk_length=lens, sink=None)  # fmt: skip
    out, lse = planted_output(case)  # a correct decode over the indices it was handed
    meta = {**case.meta(), "layer_id": imeta["layer_id"], "step": imeta["step"], "rids": imeta["rids"]}
    write_sparse(folder / "decode.safetensors", {**case.tensors(), "out": out, "lse": lse}, meta)
    kit.raw_write(folder / "indexer.safetensors", itensors, imeta)
    return folder / "decode.safetensors"


def opts():
    return ReplayOptions(backends=["reference"], tol=Tolerance())


def test_a_decode_over_the_right_indices_agrees_and_says_the_indices_were_judged(tmp_path):
    r = replay_file(pair(tmp_path), opts())
    assert r.verdict == "agree", r.diagnosis_text
    assert r.backends["indexer"].status == "pass" and r.kind_keys["indexer_capture"].endswith("indexer.safetensors")


def test_a_decode_over_stale_indices_is_a_finding_naming_the_indexer(tmp_path):
    r = replay_file(pair(tmp_path, "topk_stale"), opts())
    assert r.backends["observed"].status == "pass"  # the decode computed attention over them correctly
    assert r.verdict == "diverged" and r.exit_code == 1 and r.diagnosis == "upstream_indexer"
    e = r.backends["indexer"].explanation
    assert e is not None and e.hypothesis == "topk_stale" and e.detail["source"] == "previous_step"
    assert "indexer chose the wrong entries" in r.diagnosis_text and r.diagnosis_backends[0] == "indexer"


def test_an_indexer_capture_of_another_step_is_not_paired(tmp_path):
    path = pair(tmp_path, "topk_stale")
    t, m = kit.call(SEQ, topk=K, seed=5)
    m["step"] = 12
    (tmp_path / "indexer.safetensors").unlink()
    kit.raw_write(tmp_path / "other-step.safetensors", t, m)
    r = replay_file(path, opts())
    assert "indexer" not in r.backends and r.verdict == "agree"
