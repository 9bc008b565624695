"""The sweep's space scales with where it runs: the interpreter's bounds on CPU, production sizes on
a GPU (planned here, on CPU, without running a kernel), flags that override a bound, and the report
stating the bounds walked; the walk's first points sit on the split schedule's boundaries (and, on a
GPU, at its largest sizes), and off-by-ones planted at those boundaries in SGLang's real kernel
(tests/planted_edges.py, stage 1 and stage 2) are found by a sweep of the default budget."""

from __future__ import annotations

import json

import pytest
import torch

import planted_edges
import refmla.backends as backends
from refmla.backends.triton import TritonBackend
from refmla.cli import main
from refmla.schedule import MIN_BLOCK_KV
from refmla.sweep import SweepConfig, run_sweep
from refmla.sweep.bounds import CPU, bounds_for
from refmla.sweep.cases import case_of
from refmla.sweep.checks import CaseChecks
from refmla.sweep.space import EDGES, LAYOUTS, Walk, edge_unit, feasible, length_of, restrict

pytestmark = [pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:divide by zero encountered:RuntimeWarning")]
H100 = 80 * 2**30  # free bytes of the device the gpu profile is planned for


def _plan(layout: str, bounds, n: int = 40):
    walk = Walk(layout, restrict(layout, (), bounds), seed=0, bounds=bounds)
    it = iter(walk)
    points = [next(it) for _ in range(n)]
    return points, [case_of(layout, p, 0, i, bounds) for i, p in enumerate(points)]


@pytest.mark.parametrize("layout", ["decode", "verify", "block_table"])
def test_the_gpu_plan_reaches_production_sizes_largest_first(layout):
    gpu = bounds_for("gpu", free_bytes=H100)
    points, cases = _plan(layout, gpu)
    big = [c for c in cases if c.num_heads == 128 and len(c.seq_lens) >= 64]
    assert big and max(max(c.seq_lens) for c in cases) >= 32768, [(c.num_heads, len(c.seq_lens)) for c in cases]
    first = cases[0]  # the largest first: the longest context, the largest batch, 128 heads
    assert (first.num_heads, len(first.seq_lens), first.seq_lens[0]) == (128, 256, 131073)
    assert {"128", 256} <= {str(p["heads"]) for p in points} | {p["batch"] for p in points}
    assert all(feasible(p, layout, gpu) for p in points)


def test_the_cpu_plan_keeps_the_interpreters_bounds_and_a_small_device_cuts_the_context():
    for layout in ("decode", "verify", "block_table"):
        points, cases = _plan(layout, CPU)
        assert all(max(c.seq_lens) <= CPU.length for c in cases) and all(p["batch"] <= 64 for p in points)
        assert all(len(c.seq_lens) * max(1, c.draft_token_num) * c.num_heads <= CPU.rows for c in cases)
    assert restrict("decode")["length"] == LAYOUTS["decode"]["length"]  # the CPU's axes are the contract's
    small = bounds_for("gpu", free_bytes=64 * 2**20)  # a device with 64 MiB free: its pool holds fewer rows
    assert CPU.length < small.length < 131073 and "131073" not in restrict("decode", (), small)["length"]
    with pytest.raises(ValueError, match="sizes"):
        bounds_for("tpu")
    with pytest.raises(ValueError, match="max-length"):
        bounds_for("cpu", length=0)
    assert bounds_for("cpu", length=2049).profile == "cpu + overrides"


def test_the_report_states_the_bounds_walked_and_flags_override_them(tmp_path, capsys):
    rc = main(["sweep", "--backend", "reference", "--budget", "2", "--json", "--out", str(tmp_path), "--layout", "decode",
               "--sizes", "cpu", "--max-length", "2049", "--space", "heads=4", "--space", "batch=1"])  # fmt: skip
    rep = json.loads(capsys.readouterr().out)
    assert rc == 0 and rep["bounds"]["profile"] == "cpu + overrides" and rep["bounds"]["length"] == 2049
    assert rep["cases"] and all(max(c["params"]["seq_lens"]) <= 2049 for c in rep["cases"])
    with pytest.raises(SystemExit) as e:
        main(["sweep", "--sizes", "tpu"])
    assert e.value.code == 2


@pytest.mark.parametrize("layout", ["decode", "block_table"])
def test_boundaries_come_first_and_are_paired_with_every_split_count_and_page(layout):
    assert length_of("edge", 16, 1, edge_unit({"splits": "4"}, layout)) == 4 * {"decode": 32, "block_table": 16}[layout]
    assert length_of("edge+1", 256, 2, 64) == 513 and length_of("edge-1", 1, 1, 96) == 95
    walk = Walk(layout, restrict(layout), seed=1)
    it = iter(walk)
    points = [next(it)]
    while walk.pairs_covered < walk.pairs_total:
        points.append(next(it))
    assert [p["length"] for p in points[:3]] == list(EDGES)
    assert all(str(p["splits"]).isdigit() and int(p["splits"]) > 1 for p in points[:3])
    for edge in EDGES:  # before any random point: every split count and page meets each boundary
        for axis in ("splits", "page"):
            for v in LAYOUTS[layout][axis]:
                assert any(p["length"] == edge and p[axis] == v for p in points if feasible(p, layout)), (edge, axis, v)
    for i, p in enumerate(points[:3]):  # on the boundary: every split of request 0 exactly full
        case = case_of(layout, p, 1, i)
        L, n = case.seq_lens[0], int(p["splits"])
        if layout == "decode" and p["length"] == "edge":
            per = -(-(-(-L // n)) // MIN_BLOCK_KV) * MIN_BLOCK_KV
            assert L == n * per and L % case.page_size == 0, (L, n, per)


@pytest.mark.slow
@pytest.mark.parametrize("plant", sorted(planted_edges.EDGE_PLANTS))
def test_an_off_by_one_on_a_schedule_boundary_is_found_within_the_default_budget(plant, tmp_path, monkeypatch):
    ok, why = TritonBackend().availability()
    if not ok:
        pytest.skip(f"SGLang's Triton kernel unavailable: {why}")
    monkeypatch.setitem(backends._CACHE, "triton", planted_edges.EdgePlant(plant))
    cfg = SweepConfig(backends=["triton"], out=str(tmp_path), layouts=["decode"], checks=["reference"], max_shrink=2)
    assert cfg.budget == 60  # the default budget
    rep = run_sweep(cfg)
    (f,) = rep.findings
    first = next(c for c in rep.cases if c.index == f.first_case)
    assert f.check == "reference" and str(first.point["length"]).startswith("edge"), (f.detail, first.point)
    monkeypatch.setitem(backends._CACHE, "triton", TritonBackend())  # SGLang's own kernel passes the same case
    outcomes, _ = CaseChecks(case_of("decode", first.point, 0, first.index), cfg.options()).run("triton", ("reference",))
    assert outcomes["reference"].status == "pass", outcomes["reference"].detail


@pytest.mark.parametrize("profile", ["gpu", "production"])
@pytest.mark.parametrize("layout", ["decode", "verify", "block_table"])
def test_the_gpu_plan_reaches_int32_offsets_early(profile, layout):
    """Planning only (no kernel runs): among the first two cases of a GPU or production plan, one
    whose pool the kernel gets at rows past 2**31 / 576 (every element offset of the pool past
    int32); none on the CPU's bounds or on a device whose memory cannot hold such a pool."""
    from refmla.sweep.space import pool_span

    bounds = bounds_for(profile, free_bytes=H100)
    points, cases = _plan(layout, bounds, n=2)
    moved = [c for c in cases if c.pool_base_row * 576 >= 2**31]
    assert moved, [(p.get("pool"), c.pool_base_row) for p, c in zip(points, cases)]
    for c in moved:  # the rows it spans fit the bounds, and the row the kernel reads last is past int32 too
        rows = c.pool_base_row + pool_span(max(c.seq_lens), len(c.seq_lens), c.page_size)
        assert rows <= bounds.pool_rows and c.pool_base_row % c.page_size == 0
    for small in (CPU, bounds_for("gpu", free_bytes=2 * 2**30)):  # 2 GiB free: a quarter holds no such pool
        assert "pool" not in restrict(layout, (), small)
        assert not any(c.pool_base_row for c in _plan(layout, small, n=40)[1])


@pytest.mark.parametrize("layout", ["decode", "block_table"])
def test_a_moved_pool_is_the_same_pool_to_the_kernel(layout):
    """What a ``past-int32`` case hands the kernel (refmla.sweep.cases.moved_pool), checked on a
    small base: every request's rows read through its indices (and, for a block table, through its
    table's pages) are the compact pool's, the rows before the base all NaN; the reference backend
    on it passes the reference check, as the compact case does."""
    from dataclasses import replace

    from refmla.blocktable import token_rows
    from refmla.sweep.cases import capture_of, moved_pool

    point = {"heads": 4, "page": 16, "length": "page+1", "batch": 3, "splits": "2", "kv": "bfloat16", "cap": 0.0,
             "table": "shuffled", "null": "nan"}  # fmt: skip
    case = replace(case_of(layout, point, 0, 0), pool_base_row=256 * 3)
    cap = capture_of(case)
    moved = moved_pool(cap, case.pool_base_row)
    assert moved.kv_buffer.shape[0] == cap.kv_buffer.shape[0] + 768 and bool(moved.kv_buffer[:768].isnan().all())
    assert torch.equal(moved.kv_buffer[moved.kv_indices.long()].view(torch.int16),
                       cap.kv_buffer[cap.kv_indices.long()].view(torch.int16))  # fmt: skip
    if layout == "block_table":
        _, rows = token_rows(moved.block_table, moved.seq_lens, case.page_size)
        assert torch.equal(rows.long(), moved.kv_indices.long())
    outcomes, _ = CaseChecks(case, SweepConfig(backends=["reference"]).options()).run("reference", ("reference",))
    assert outcomes["reference"].status == "pass", outcomes["reference"].detail
