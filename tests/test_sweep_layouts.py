"""refmla sweep's block_table and sparse layouts (issue 30): each walked pairwise from the seed, its
cases built as production lays them out (vLLM's null block and tables; DeepSeek's packed caches,
-1 padding and lonely rows), the backends that read each layout, a correct kernel passing a small
sweep of each, and a fault planted at run time in each layout's real kernel (tests/planted_layouts.py)
found under its check, shrunk, and written as a capture `refmla replay` calls diverged."""

from __future__ import annotations

import itertools

import pytest
import torch

import planted_layouts
import refmla.backends as backends
from refmla import blocktable
from refmla.backends.vllm_triton import VllmTritonBackend
from refmla.capture import read_capture, write_capture
from refmla.cli import main
from refmla.options import ReplayOptions
from refmla.pipeline import replay_file
from refmla.schedule import vllm_num_kv_splits
from refmla.sparse import backends as sparse_backends
from refmla.sparse.reference import rows_of
from refmla.sparse.validation import read_sparse, write_sparse
from refmla.sweep import SweepConfig, run_sweep
from refmla.sweep.cases import TABLE_FP8_SCALE, capture_meta, capture_of, case_of, split_alternatives
from refmla.sweep.kernels import LAYOUT_BACKENDS, availability, default_backends
from refmla.sweep.run import Sweeper
from refmla.sweep.space import LAYOUTS, Walk, feasible, restrict, sparse_valid
from refmla.sweep.sparse import NO_BUFFERS, NO_SPLITS, SparseChecks, sparse_case
from test_paged_adapters import standins  # noqa: F401  (the NVIDIA stand-ins' fixture)

# the interpreter evaluates masked-off lanes too (-inf - -inf, x / 0); the kernels mask the results
pytestmark = [pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:divide by zero encountered:RuntimeWarning")]
NEW = ("block_table", "sparse")


def _walk(layout: str, seed: int):
    """The covering phase's points and then five random ones."""
    walk = Walk(layout, restrict(layout), seed)
    it = iter(walk)
    points = [next(it)]
    while walk.pairs_covered < walk.pairs_total:
        points.append(next(it))
    return walk, points + [next(it) for _ in range(5)]


@pytest.mark.parametrize("layout", NEW)
def test_each_new_layout_is_walked_pairwise_every_value_early_reproducibly(layout):
    walk, points = _walk(layout, seed=3)
    covering = points[: walk.pairwise_points]
    assert walk.pairs_total > 100 and walk.pairwise_points == len(points) - 5
    for (a, va), (b, vb) in walk._pairs():
        assert any(p[a] == va and p[b] == vb for p in covering), (a, va, b, vb)
    axes = LAYOUTS[layout]
    widest = max(len(v) for v in axes.values())
    for axis, values in axes.items():  # every value of every axis within the first points of the walk
        first = [next(i for i, p in enumerate(points) if p[axis] == v) for v in values]
        assert max(first) < 2 * widest, (axis, dict(zip(values, first)))
    assert all(feasible(p, layout) for p in points) and all(set(p) == set(axes) for p in points)
    assert _walk(layout, seed=3)[1] == points and _walk(layout, seed=4)[1] != points


def test_a_restriction_applies_to_the_layouts_whose_axis_has_the_value():
    assert restrict("decode", ["splits=past"])["splits"] == ("past",)
    assert restrict("block_table", ["splits=past"])["splits"] == LAYOUTS["block_table"]["splits"]  # not its value
    assert restrict("block_table", ["splits=1,past,rule"])["splits"] == ("1", "rule")
    assert restrict("sparse", ["page=256,16", "cache=v32"]) == {**LAYOUTS["sparse"], "page": (256,), "cache": ("v32",)}
    assert restrict("decode", ["table=shared", "cache=v32"]) == LAYOUTS["decode"]  # axes of other layouts
    for bad, what in (["splits=nope"], "splits"), (["topk=3"], "topk"), (["null=zero"], "null"):
        with pytest.raises(ValueError, match=what):
            restrict("block_table", bad)


def _table(**over):
    point = {"heads": 16, "page": 16, "length": "2page+1", "batch": 3, "splits": "rule", "kv": "float8_e4m3fn",
             "table": "shared", "null": "stale", **over}  # fmt: skip
    return case_of("block_table", point, seed=2, index=7)


@pytest.mark.parametrize("table", ["shared", "shuffled", "ordered"])
@pytest.mark.parametrize("null", ["stale", "nan"])
def test_a_block_table_case_is_laid_out_as_vllm_lays_it_out(table, null, tmp_path):
    case = _table(table=table, null=null)
    cap = capture_of(case)
    P, lens, t = case.page_size, case.seq_lens, cap.block_table.long()
    assert lens[0] == 33 and min(lens) >= 1 and case.k_scale == case.v_scale == TABLE_FP8_SCALE
    assert cap.meta.split_schedule == "uniform" and cap.meta.null_block == 0
    assert set(cap.num_kv_splits.tolist()) == {vllm_num_kv_splits(max(lens))}
    need = [-(-L // P) for L in lens]
    rows = []
    for b, L in enumerate(lens):  # the table read with a plain loop: position j of b is page t[b, j // P]
        assert (t[b, need[b] :] == 0).all() and (t[b, : need[b]] > 0).all() and t.shape[1] == max(need) + 2
        rows += [int(t[b, j // P]) * P + j % P for j in range(L)]
    assert cap.kv_indices.tolist() == rows
    assert not blocktable.problems(t, cap.seq_lens, P, cap.kv_buffer.shape[0]).errors
    kv = cap.kv_buffer.float()
    assert torch.isfinite(kv[rows]).all() and bool(torch.isfinite(kv[:P]).all()) == (null == "stale")
    others = sorted(set(range(P, kv.shape[0])) - set(rows))
    assert others and torch.isnan(kv[others]).all()  # last pages' tails and the free pages
    # prefix caching: request b's leading full pages are request 0's full pages (never b's own last page)
    shared = [0] + [min(lens[0] // P, (L - 1) // P) if table == "shared" else 0 for L in lens[1:]]
    for b, k in enumerate(shared):
        assert (t[b, :k] == t[0, :k]).all()
    assert len(t[t > 0].unique()) == sum(need) - sum(shared)  # every other page is a request's own
    assert (table == "ordered") == bool((t[0, : need[0]] == torch.arange(1, need[0] + 1)).all())
    path = write_capture(tmp_path / "table.safetensors", cap.tensors(), capture_meta(case), compact=False)
    back = read_capture(path)
    assert torch.equal(back.block_table, cap.block_table) and back.meta.split_schedule == "uniform"


def test_block_table_split_alternatives_are_one_count_for_the_batch():
    case = _table(splits="3")
    assert case.splits == (3,) * len(case.seq_lens) and len(case.seq_lens) == 3
    assert split_alternatives(case) == [(1, 1, 1), (16, 16, 16)]
    short = _table(heads=4, page=1, length="page-1", batch=1, splits="2", kv="bfloat16")
    assert short.seq_lens == (1,) and split_alternatives(short) == [(1,), (2,)]  # one past the longest length
    assert short.k_scale == short.v_scale == 1.0


@pytest.mark.parametrize("cache", ["v4-c4", "v4-c128", "v4-swa", "v32"])
def test_a_sparse_case_has_the_valid_entries_its_point_names(cache, tmp_path):
    point = {"cache": cache, "heads": 8, "topk": 64, "length": "width-1", "batch": 3, "page": 64, "sink": "large",
             "topk_length": "given"}  # fmt: skip
    case = sparse_case(point, seed=1, index=2)
    cap = case.capture()
    rows = rows_of(cap)
    ratio = {"v4-c4": 4, "v4-c128": 128, "v4-swa": 1, "v32": 1}[cache]
    width = 128 if cache == "v4-swa" else 64
    assert case.seq_lens[0] == (width - 1) * ratio
    for b, L in enumerate(case.seq_lens):
        assert int(rows.valid[b].sum()) == sparse_valid(L, cache, 64), (b, L)
    assert cap.q.shape[2] == 8 and bool((cap.attn_sink > 5).all()) and cap.meta.page_size == 64
    if cache in ("v4-c4", "v4-c128"):
        assert cap.meta.extra_page_size == max(1, 64 // ratio) and cap.extra_indices.shape[-1] == 64
    assert cap.meta.kv_layout == ("v32" if cache == "v32" else "v4")
    lonely = sparse_case({**point, "length": "0", "batch": 1, "topk_length": "none", "sink": "off"}, 1, 3).capture()
    assert lonely.topk_length is None and lonely.attn_sink is None and bool(rows_of(lonely).lonely.all())
    idx = lonely.indices if lonely.extra_indices is None else lonely.extra_indices
    assert (idx == -1).all()  # without lengths the stale tail is -1 padding
    path = write_sparse(tmp_path / "sparse.safetensors", *case.tensors_and_meta())
    assert torch.equal(read_sparse(path).indices, cap.indices)


def test_each_backend_sweeps_the_layouts_it_reads():
    ok, why = availability("aiter_sparse", "decode")
    assert not ok and "sparse layout only" in why
    ok, why = availability("extend", "sparse")
    assert not ok and "dense kernel" in why
    assert availability("reference", "sparse")[0] and availability("reference", "block_table")[0]
    assert default_backends(["decode", "block_table"])[:4] == ["triton", "aiter", "extend", "vllm_triton"]
    cfg = SweepConfig(backends=default_backends(list(LAYOUTS)), per_layout=LAYOUT_BACKENDS, budget=1)
    rep = Sweeper(cfg).report
    extend = rep.backends["extend"]
    assert set(extend.skipped_layouts) == {"block_table", "sparse", "indexer"}
    assert "reads no indexer capture" in extend.skipped_layouts["indexer"]
    assert "default kernels" in extend.skipped_layouts["block_table"] and "dense" in extend.skipped_layouts["sparse"]
    if rep.backends["vllm_triton"].available:
        assert set(rep.backends["vllm_triton"].skipped_layouts) == {"decode", "verify", "sparse", "indexer"}
    for name in ("aiter_sparse", "tilelang", "flashmla_sparse"):
        b = rep.backends[name]  # unavailable on a CPU (with the reason), never on a dense layout
        assert not b.available or set(b.skipped_layouts) >= {"decode", "verify", "block_table"}
    assert rep.not_walked == []


def test_a_layout_no_backend_takes_is_not_walked(tmp_path):
    cfg = SweepConfig(backends=["reference"], per_layout={"sparse": ("reference",)}, layouts=["decode", "sparse"],
                      budget=600, max_cases=2, out=str(tmp_path), space=["heads=4", "batch=1", "length=1"])  # fmt: skip
    rep = run_sweep(cfg)
    assert [c.layout for c in rep.cases] == ["sparse", "sparse"] and list(rep.pairs) == ["sparse"]
    assert "default kernels" in rep.backends["reference"].skipped_layouts["decode"]


def test_a_sparse_point_a_kernel_cannot_read_is_na_with_the_reason():
    case = sparse_case({"cache": "v32", "heads": 16, "topk": 64, "length": "1", "batch": 1, "page": 64, "sink": "off",
                        "topk_length": "given"}, 0, 0)  # fmt: skip
    outcomes, _ = SparseChecks(case, ReplayOptions()).run("triton")
    assert {o.status for o in outcomes.values()} == {"n/a"} and "V4 layout only" in outcomes["reference"].detail
    outcomes, _ = SparseChecks(case, ReplayOptions()).run("reference")
    assert [outcomes[c].status for c in ("reference", "nan_fill", "repeat", "splits")] == ["pass", "n/a", "pass", "n/a"]
    assert outcomes["nan_fill"].detail == NO_BUFFERS and outcomes["splits"].detail == NO_SPLITS


def test_the_new_layouts_give_the_same_cases_in_workers_as_serially(tmp_path):
    cfg = dict(backends=["reference"], budget=600, out=str(tmp_path), max_cases=4, layouts=list(NEW),
               space=["heads=4", "batch=1,2", "length=1,65", "page=1,64"])  # fmt: skip
    serial = run_sweep(SweepConfig(**cfg))
    parallel = run_sweep(SweepConfig(**cfg, jobs=2))
    assert [c.layout for c in serial.cases] == ["block_table"] * 2 + ["sparse"] * 2
    ran = {(c.layout, c.index): c.params for c in parallel.cases}  # (the workers may finish one more)
    assert all(ran[(c.layout, c.index)] == c.params for c in serial.cases)
    assert all(c.outcomes["reference"]["reference"].status == "pass" for c in parallel.cases)


def test_an_nvidia_block_table_kernel_sweeps_block_tables_where_it_runs(standins, tmp_path):
    """FlashMLA through its adapter, against tests/standins' stand-in of its signature (the fp64
    reference behind it: this is the wiring, not a kernel): available, a point it cannot take n/a
    with its reason (an e4m3fnuz pool), every other one judged."""
    space = ["heads=16,4", "batch=1,2", "length=page+1", "page=16,64", "kv=float8_e4m3fnuz,bfloat16"]
    rep = run_sweep(SweepConfig(backends=["flashmla"], budget=600, out=str(tmp_path), layouts=["block_table"],
                                max_cases=3, space=space, max_shrink=0))  # fmt: skip
    b = rep.backends["flashmla"]
    assert b.available and "stand-in" in b.reason and rep.exit_code == 0 and len(rep.cases) == 3
    for c in rep.cases:
        o = c.outcomes["flashmla"]
        if c.point["kv"] == "float8_e4m3fnuz":
            assert {x.status for x in o.values()} == {"n/a"} and "e4m3fn" in o["reference"].detail
        else:
            assert [o[k].status for k in ("reference", "nan_fill", "repeat", "splits")] == ["pass", "n/a", "pass", "n/a"]
    assert {c.point["kv"] for c in rep.cases} == {"float8_e4m3fnuz", "bfloat16"} and not b.skipped_layouts


def _ready(layout: str) -> None:
    name = "vllm_triton" if layout == "block_table" else "triton"
    ok, why = availability(name, layout)
    if not ok:
        pytest.skip(f"{name} unavailable for {layout}: {why}")


SMALL = {  # a handful of hostile points each, cheap in the interpreter
    "block_table": ["heads=16,4", "page=1,16,64", "length=page+1,2page+1,1023", "batch=1,3", "splits=rule,3,16"],
    "sparse": ["heads=16,8", "batch=1,3", "length=0,65,width-1", "topk=64,512", "page=1,64,256"],
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", NEW)
def test_a_correct_kernel_passes_a_small_sweep_of_each_new_layout(layout, tmp_path):
    """vLLM's TRITON_MLA on block tables, SGLang's Triton sparse kernel on sparse: no false alarm."""
    _ready(layout)
    name = "vllm_triton" if layout == "block_table" else "triton"
    cases = 3 if layout == "block_table" else 5
    rep = run_sweep(SweepConfig(backends=[name], budget=600, out=str(tmp_path), layouts=[layout], max_cases=cases,
                                space=SMALL[layout], max_shrink=0))  # fmt: skip
    assert len(rep.cases) == cases and rep.exit_code == 0, [f.detail for f in rep.findings]
    counts = rep.backends[name].counts
    assert counts["reference"].get("pass", 0) >= 3 and not counts["reference"].get("fail")
    assert counts["repeat"].get("pass", 0) >= 3
    if layout == "block_table":  # the adapter allocates o, lse and attn_logits; one split count for the batch
        assert counts["nan_fill"].get("pass") == counts["splits"].get("pass") == cases
    else:
        assert counts["nan_fill"] == {"n/a": cases} and counts["splits"] == {"n/a": cases}


@pytest.mark.slow
@pytest.mark.parametrize("plant", sorted(planted_layouts.PLANTS))
def test_a_planted_fault_of_each_new_layout_is_found_shrunk_and_replays_diverged(plant, tmp_path, monkeypatch, capsys):
    """The two-point sweep of the plant's space finds it under its check, the trigger names the
    point's edge, the shrunk capture replays diverged, and the installed kernel passes the case."""
    layout, check = planted_layouts.LAYOUT[plant], planted_layouts.EXPECTED[plant]
    _ready(layout)
    name = "vllm_triton" if layout == "block_table" else "triton"
    if layout == "block_table":
        monkeypatch.setitem(backends._CACHE, "vllm_triton", planted_layouts.PlantedVllm(plant))
    else:
        monkeypatch.setitem(sparse_backends.BACKENDS, "triton", planted_layouts.planted_sparse_triton(plant))
    checks = sorted({check, "reference"})
    cfg = SweepConfig(backends=[name], budget=600, out=str(tmp_path), layouts=[layout], max_cases=2, checks=checks,
                      space=planted_layouts.QUICK_SPACE[plant], max_shrink=4)  # fmt: skip
    rep = run_sweep(cfg)
    found = {f.check: f for f in rep.findings}
    assert rep.exit_code == 1 and set(found) == set(checks), [(f.check, f.detail) for f in rep.findings]
    ref = found["reference"].trigger  # one point each side of the edge: the failing one is named
    assert ref.whenever and (ref.axis, ref.value) == (("splits", "3") if plant == "split_floor" else ("length", "65"))
    f = found[check]
    assert f.capture and f.replay_verdict == "diverged" and f.backend == name, f
    first = next(c for c in rep.cases if c.index == f.first_case)
    assert len(f.shrunk["seq_lens"]) <= len(first.params["seq_lens"])
    assert f.shrunk["num_heads"] <= first.params["num_heads"] and f.shrink_steps
    report = replay_file(f.capture, ReplayOptions(backends=[], explain=False))
    assert report.backends["observed"].status == "fail" and report.backends["reference"].status == "pass"
    monkeypatch.undo()  # the installed kernel: the first failing case passes, and replays the capture apart from it
    from refmla.sweep.sparse import any_case, any_checks

    outcomes, _ = any_checks(any_case(layout, first.point, 0, first.index), cfg.options()).run(name, (check,))
    assert outcomes[check].status == "pass", outcomes[check].detail
    capsys.readouterr()
    assert main(["replay", f.capture, "--backend", name]) == 1
    assert "diverged" in capsys.readouterr().out


def test_the_plants_edit_one_line_each_of_a_real_kernel():
    assert set(planted_layouts.PLANTS) == set(planted_layouts.EXPECTED) == set(planted_layouts.QUICK_SPACE)
    for module, func, old, new in planted_layouts.PLANTS.values():
        assert old != new and func.startswith(("_fwd_", "_fused_")) and module.startswith(("vllm.", "sglang."))
    assert set(itertools.chain(planted_layouts.LAYOUT.values())) == set(NEW)
    assert VllmTritonBackend.fills_buffers  # nan_fill applies to vLLM's adapter (it allocates o, lse, attn_logits)
