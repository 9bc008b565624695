"""`refmla sweep`'s indexer layout: the engines' indexer code (SGLang's and vLLM's torch paths, run
as installed) walked over index heads, lengths around the pages and the top-k width, V3.2 / V4 C4,
fp8 / bf16, judged by the set judge: no false alarm on the real code; an off-by-one on the causal
bound planted by the test on vLLM's code is found, shrunk, written as an indexer capture that
`refmla replay` reads as diverged."""

from __future__ import annotations

import dataclasses

import pytest

from refmla.indexer import backends
from refmla.indexer.io import read_indexer
from refmla.sweep import SweepConfig, run_sweep
from refmla.sweep.kernels import availability, not_read
from refmla.sweep.space import LAYOUTS, Walk, feasible, restrict


def test_the_indexer_layout_is_walked_pairwise_within_the_cpu_bounds():
    walk = Walk("indexer", restrict("indexer"), seed=2)
    it = iter(walk)
    points = [next(it)]
    while walk.pairs_covered < walk.pairs_total:
        points.append(next(it))
    assert walk.pairs_total > 100 and all(feasible(p, "indexer") for p in points)
    for axis, values in LAYOUTS["indexer"].items():
        assert {p[axis] for p in points} == set(values), axis


def test_which_backends_read_the_indexer_layout():
    assert not_read("sglang_indexer_torch", "indexer") is None and not_read("reference", "indexer") is None
    assert "reads no indexer capture" in not_read("triton", "indexer")
    assert "indexer layout only" in not_read("vllm_indexer_torch", "decode")
    ok, why = availability("deepgemm_paged", "indexer")
    assert not ok and "deep_gemm" in why  # not installed here: said, not run


def config(tmp_path, **kw):
    base = dict(backends=["vllm_indexer_torch"], layouts=("indexer",), budget=60, max_cases=6, out=str(tmp_path / "out"),
                space=["keys=fp8", "heads=8,32", "topk=64,128"], per_layout=None, max_shrink=8)  # fmt: skip
    return SweepConfig(**{**base, **kw})


@pytest.mark.slow
def test_the_engines_indexer_code_has_no_false_alarm(tmp_path):
    report = run_sweep(config(tmp_path, backends=["vllm_indexer_torch", "sglang_indexer_torch"], max_cases=5,
                              space=["heads=8,32", "topk=64,128"]))  # fmt: skip
    for name in ("vllm_indexer_torch", "sglang_indexer_torch"):
        b = report.backends[name]
        assert b.available and not b.findings, [f.detail for f in b.findings]
        assert b.counts["reference"].get("pass", 0) >= 2 and b.counts["reference"].get("fail", 0) == 0
        assert b.counts["repeat"].get("pass", 0) >= 2


def test_an_off_by_one_causal_bound_is_found_shrunk_and_replays_diverged(tmp_path, monkeypatch):
    real = backends.BACKENDS["vllm_indexer_torch"]

    def newest_never_scored(cap):  # the bound one entry short: seq_len - ratio tokens scored
        short = dataclasses.replace(cap, seq_lens=(cap.seq_lens - cap.meta.compress_ratio).clamp(min=0))
        return real(short)

    monkeypatch.setitem(backends.BACKENDS, "vllm_indexer_torch", newest_never_scored)
    report = run_sweep(config(tmp_path, space=["keys=fp8", "heads=8", "topk=64,128", "length=1,63,65,topk+1"]))
    found = [f for f in report.backends["vllm_indexer_torch"].findings if f.check == "reference"]
    assert found, report.backends["vllm_indexer_torch"].counts
    f = found[0]
    assert f.layout == "indexer" and f.capture and f.replay_verdict == "diverged", (f.shrunk_detail, f.replay_verdict)
    cap = read_indexer(f.capture)  # the shrunk case: the engine's indices as production's
    assert cap.meta.extra["sweep"]["backend"] == "vllm_indexer_torch" and "wrong entries" in f.detail
