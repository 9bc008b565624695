"""A sparse top-k kernel outside refmla (refmla.kernel layout ``sparse_topk``, docs/own-kernel.md):
the example's PyTorch sparse decode (examples/my_kernel/my_kernel/sparse.py), loaded by module, by
path and through an entry point, is judged by replay (refmla.kinds.SparseKind through
pipeline.run_backend), the sparse goldens and the sweep's sparse layout as refmla's own sparse
kernels are; a bug planted in a copy of it (tests/own_kernel_kit.py, not by refmla) is found by
the sweep and named by replay; a callable that does not meet the interface is one line, exit 2.
"""

from __future__ import annotations

import json

import pytest
import torch

import refmla.api as api
from refmla.kernel import InterfaceError, KernelOutputs, declare
from refmla.sparse.arithmetic import TILELANG_SPARSE
from refmla.sweep import SweepConfig, run_sweep

from own_kernel_kit import EXAMPLE, GOLDEN, SPARSE_SPEC, cli, entry_point_dir, planted

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

SPARSE = GOLDEN / "sparse"
V4 = SPARSE / "dsv4-flash-c4-h8.safetensors"  # window + C4 caches, a sink, stale tails past topk_length
V32 = SPARSE / "dsv32-dsa-h16.safetensors"  # the 656-byte layout, top-k 2048
DENSE = GOLDEN / "kimi-h8-len1-31-32-33.safetensors"


@pytest.fixture
def example(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLE))
    from my_kernel.sparse import sparse_decode

    return sparse_decode


def test_clean_example_passes_both_layouts_by_the_api(example):
    for path in (V4, V32):
        report = api.replay(path, backends={"mine": example}, explain=False, repeat=2)
        assert report.kind == "sparse_decode" and list(report.backends) == ["reference", "observed", "mine"]
        e = report.backends["mine"]
        assert e.status == "pass", (path.name, e.reason)
        assert e.info["repeat"]["deterministic"] and e.info["layout"] == "sparse_topk"
        assert e.lse is not None and e.lse.status == "pass"  # its lse is judged
        assert e.info["arithmetic"]["partials"] == "none"  # judged at the arithmetic it declares


def test_what_the_kernel_is_handed(example):
    seen = {}

    @declare(layout="sparse_topk")
    def spy(inp):
        seen["inp"] = inp
        return example(inp)

    api.replay(V32, backends={"spy": spy}, explain=False)
    inp = seen["inp"]
    B, S, H, D = inp.q.shape
    assert (inp.kv_layout, D, inp.head_dim_v) == ("v32", 576, 512) and inp.q.dtype == torch.bfloat16
    assert inp.k_cache.dtype == torch.uint8 and tuple(inp.k_cache.shape[1:]) == (inp.page_size, 1, 656)  # as stored
    assert inp.k_values.shape == (inp.k_cache.shape[0] * inp.page_size, D)  # decoded, token t = page * P + offset
    assert inp.indices.dtype == torch.int32 and inp.indices.shape[:2] == (B, S) and bool((inp.indices == -1).any())
    assert inp.extra_k_cache is None and inp.attn_sink is None  # V3.2: one cache, no sink


def test_a_declared_arithmetic_is_the_control_it_is_judged_at(example):
    tilelang = declare(layout="sparse_topk", arithmetic=TILELANG_SPARSE)(lambda inp: example(inp))
    e = api.replay(V4, backends={"t": tilelang}, explain=False).backends["t"]
    assert e.info["arithmetic"]["partials"] == "bf16" and e.info["arithmetic"]["group"] == 64


def test_a_sparse_kernel_is_not_run_on_a_dense_capture_nor_a_dense_one_on_a_sparse_capture(example):
    e = api.replay(DENSE, backends={"mine": example}, explain=False).backends["mine"]
    assert e.status == "skipped" and "sparse decode captures only" in e.reason
    dense = declare(layout="token_slots")(lambda inp: inp.out.zero_())
    assert "d" not in api.replay(V4, backends={"d": dense}, explain=False).backends


def test_interface_errors_are_one_line_exit_2(tmp_path):
    wrong = declare(layout="sparse_topk")(lambda inp: KernelOutputs(out=torch.zeros(inp.q.shape[:3] + (512,))))  # fp32
    with pytest.raises(InterfaceError, match=r"returned out float32 \[3, 1, 16, 512\]; expected bfloat16 \[3, 1, 16, 512\]"):
        api.replay(V32, backends={"k": wrong}, explain=False)
    bad_decl = declare(layout="sparse_topk", arithmetic="bf16 please")(lambda inp: None)
    with pytest.raises(InterfaceError, match=r"declares a refmla.sparse.arithmetic.SparseArithmetic, got str"):
        api.replay(V32, backends={"k": bad_decl}, explain=False)
    (tmp_path / "k.py").write_text("import torch\nfrom refmla.kernel import declare\n\n@declare(layout='sparse_topk')\n"
                                   "def k(inp):\n    return inp.q.float()\n")  # fmt: skip
    p = cli("replay", str(V32), "--backend", f"{tmp_path}/k.py:k")
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "returned out float32 [3, 1, 16, 576]; expected bfloat16 [3, 1, 16, 512]" in lines[0], p.stderr


def test_a_sparse_kernel_that_raises_is_its_error():
    boom = declare(layout="sparse_topk")(lambda inp: (_ for _ in ()).throw(RuntimeError("top-k tile 2 not implemented")))
    report = api.replay(V4, backends={"b": boom}, explain=False)
    assert report.backends["b"].status == "error" and "tile 2" in report.backends["b"].reason
    assert report.verdict == "diverged"


def test_entry_point_goldens_and_doctor(tmp_path):
    eps = entry_point_dir(tmp_path, more={"my_kernel_sparse": SPARSE_SPEC})
    doctor = cli("doctor", "--json", path=(eps,))
    assert doctor.returncode == 0, doctor.stderr
    row = next(r for r in json.loads(doctor.stdout) if r["backend"] == "my_kernel_sparse")
    assert row["usable"] and row["kernel"] == SPARSE_SPEC and row["kind"] == "sparse_decode"
    check = cli("golden", "check", str(GOLDEN), "--backend", "my_kernel_sparse", "--json", path=(eps,))
    assert check.returncode == 0, check.stderr
    got = json.loads(check.stdout)
    assert [(r["case"], r["status"]) for r in got] == [("dsv4-flash-c4-h8", "pass"), ("dsv4-flash-c128-h8-lonely", "pass"),
                                                       ("dsv32-dsa-h16", "pass")]  # fmt: skip
    replay = cli("replay", str(V4), "--json", "--no-explain", path=(eps,))  # the default set of a sparse capture
    assert json.loads(replay.stdout)["backends"]["my_kernel_sparse"]["status"] == "pass", replay.stderr[-800:]


def test_clean_example_passes_the_sparse_kernel_regression_suite():
    import os
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(EXAMPLE.parents[1]), str(EXAMPLE)]))
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/kernel_regression/test_sparse_golden.py",
                        "--backend", SPARSE_SPEC, "-k", "my_kernel and not regenerate"], capture_output=True, text=True, env=env,
                       cwd=EXAMPLE.parents[1], timeout=900)  # fmt: skip
    assert p.returncode == 0 and "3 passed" in p.stdout, p.stdout[-2000:]


def test_topk_length_bug_found_by_the_sweep_and_named_by_replay(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLE))
    spec = planted("topk_length", tmp_path)
    clean = SweepConfig(backends=[SPARSE_SPEC], budget=60, max_cases=3, layouts=("sparse",), space=["heads=8"], repeat=2,
                        max_shrink=3, out=str(tmp_path / "clean"))  # fmt: skip
    b = run_sweep(clean).backends[SPARSE_SPEC]
    assert b.available and not b.findings and b.counts["reference"].get("pass") == 3, b.counts
    buggy = run_sweep(SweepConfig(**{**clean.__dict__, "backends": [spec], "out": str(tmp_path / "sw")})).backends[spec]
    found = [f for f in buggy.findings if f.check == "reference" and f.capture]
    assert found and found[0].replay_verdict == "diverged", [f.detail for f in buggy.findings]
    e = api.replay(V4, [spec]).backends[spec]
    assert e.status == "fail" and e.explanation is not None
    assert e.explanation.hypothesis == "topk_length_ignored", e.explanation.text()
    assert e.localization.requests[0] == 0 and e.localization.entries  # the top-k entries that bring a row back
