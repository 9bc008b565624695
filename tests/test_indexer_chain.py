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
from refmla.pipeline import replay_file
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


def v4_pair(folder, fault="none"):
    """A DeepSeek-V4 C4 decode (window cache + compressed cache, sink) whose compressed entries are
    what the C4 indexer produced (its pages of 64 compressed entries: the compressed cache's pages)."""
    p = sparse_preset("deepseek-v4-flash-tp8")
    seq, K2 = [400, 2100, 3000], 512
    g = torch.Generator().manual_seed(4)
    main, tok = _paged_pool(seq, "v4", p.page_size, g)
    extra, etok = _paged_pool([n // 4 for n in seq], "v4", 64, g)
    rows = torch.full((len(seq), p.topk), -1, dtype=torch.int32)
    for b, n in enumerate(seq):  # the window: the last 128 positions, in order
        w = tok[b][max(0, n - p.window) : n]
        rows[b, : len(w)] = w.int()
    M = max(-(-(n // 4) // 64) for n in seq) + 1
    table = torch.full((len(seq), M), -1, dtype=torch.int32)
    for b, t in enumerate(etok):
        pg = (t[::64] // 64).int()
        table[b, : len(pg)] = pg
    itensors, imeta = kit.call(seq, ratio=4, topk=K2, seed=6, kind="slots", fault=fault, pages=(table, extra.pages.shape[0]))
    slots = itensors["indices"]
    case = SparseCase(preset=p, q=torch.randn(len(seq), 1, p.heads, 512, generator=g).to(torch.bfloat16), main=main,
                      indices=rows[:, None], topk_length=(rows != -1).sum(1).int(), sink=torch.randn(p.heads, generator=g),
                      extra=extra, extra_indices=slots[:, None].int(), extra_topk_length=(slots != -1).sum(1).int())  # fmt: skip
    out, lse = planted_output(case)
    meta = {**case.meta(), "layer_id": imeta["layer_id"], "step": imeta["step"], "rids": imeta["rids"]}
    write_sparse(folder / "decode.safetensors", {**case.tensors(), "out": out, "lse": lse}, meta)
    kit.raw_write(folder / "indexer.safetensors", itensors, imeta)
    return folder / "decode.safetensors"


def test_a_v4_c4_decode_judges_its_compressed_entries_by_the_c4_indexer(tmp_path):
    for sub in ("clean", "off"):
        (tmp_path / sub).mkdir()
    r = replay_file(v4_pair(tmp_path / "clean"), opts())
    assert r.verdict == "agree" and r.backends["indexer"].status == "pass", r.diagnosis_text
    r = replay_file(v4_pair(tmp_path / "off", "topk_off_by"), opts())
    assert r.backends["observed"].status == "pass" and r.diagnosis == "upstream_indexer"
    e = r.backends["indexer"].explanation
    assert e is not None and e.hypothesis == "topk_off_by" and e.detail["by"] == 1


def test_a_diverging_decode_over_wrong_indices_names_the_indexer_first(tmp_path):
    path = pair(tmp_path, "topk_unwritten")
    from refmla.sparse.validation import read_sparse

    cap = read_sparse(path)
    t = cap.tensors()
    t["out"] = (t["out"].float() + 1).to(t["out"].dtype)  # production's output off as well
    write_sparse(path, t, cap.meta.to_json())
    r = replay_file(path, opts())
    assert r.backends["observed"].status == "fail" and r.diagnosis == "upstream_indexer"
    assert r.diagnosis_backends[0] == "indexer" and "upstream of the decode's own divergence" in r.diagnosis_text


def test_an_unusable_indexer_capture_beside_is_skipped_with_its_reason(tmp_path):
    path = pair(tmp_path)
    t, m = kit.call(SEQ, topk=K, seed=5)
    t["indices"] = t["indices"][:, :7]  # not topk wide
    kit.raw_write(tmp_path / "indexer.safetensors", t, m)
    r = replay_file(path, opts())
    e = r.backends["indexer"]
    assert e.status == "skipped" and "indexer.safetensors" in e.reason and "tensor 'indices'" in e.reason
    assert r.verdict == "agree"
