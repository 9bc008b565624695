"""refmla sweep: the walk's coverage and reproducibility, its flags, and the four faults of
tests/planted_sweep.py planted in SGLang's real Triton kernel, each found under its check, shrunk,
and written as a capture that `refmla replay` calls diverged -- while the unmodified kernel
passes the same cases."""

from __future__ import annotations

import itertools
import json
import os

import pytest

import planted_sweep
import refmla.backends as backends
from refmla.backends.triton import TritonBackend
from refmla.cli import main
from refmla.sweep import SweepConfig, run_sweep
from refmla.sweep.cases import case_of
from refmla.sweep.checks import CaseChecks
from refmla.sweep.space import Walk, feasible, length_of, restrict

pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")


def test_pairwise_walk_covers_every_pair_then_goes_random():
    axes = restrict("decode", ["heads=32,8,4", "page=1,16", "batch=1,3", "splits=1,past"])
    walk = Walk("decode", axes, seed=5)
    it = iter(walk)
    points = [next(it) for _ in range(40)]
    covering = points[: walk.pairwise_points]
    assert walk.pairs_covered == walk.pairs_total > 0
    for (a, va), (b, vb) in (p for p in walk._pairs()):
        assert any(pt[a] == va and pt[b] == vb for pt in covering), (a, va, b, vb)
    assert walk.pairwise_points < 40 and all(feasible(p) for p in points)
    again = iter(Walk("decode", axes, seed=5))
    assert [next(again) for _ in range(40)] == points  # reproducible from the seed
    other = iter(Walk("decode", axes, seed=6))
    assert [next(other) for _ in range(40)] != points


@pytest.mark.parametrize("layout", ["decode", "verify", "block_table", "sparse"])
def test_every_axis_value_comes_first(layout):
    """Each value of each axis within the first points (about as many as the widest axis has
    values): heads = 32 is met early, not after every pair of the other axes."""
    widest = max(len(v) for v in restrict(layout).values())
    for seed in range(3):
        it = iter(Walk(layout, restrict(layout), seed))
        points = [next(it) for _ in range(widest + 1)]
        for axis, values in restrict(layout).items():
            assert {p[axis] for p in points} == set(values), (seed, axis)


def _results(fails):
    """CaseResults over a heads x kv x page grid, ``reference`` failing where ``fails(point)``."""
    from refmla.sweep.report import CaseResult, CheckOutcome

    out = []
    for i, (h, kv, page) in enumerate(itertools.product((32, 16, 8), ("bfloat16", "float8_e4m3fn"), (1, 16))):
        point = {"heads": h, "kv": kv, "page": page}
        res = CaseResult(i, "decode", point, {})
        res.outcomes["k"] = {"reference": CheckOutcome("reference", "fail" if fails(point) else "pass")}
        out.append(res)
    return out


def test_the_trigger_names_one_axis_or_two_at_once():
    from refmla.sweep.report import trigger

    t = trigger(_results(lambda p: p["heads"] == 32 and p["kv"] == "float8_e4m3fn"), "k", "reference")
    assert (t.axis, t.value, t.and_axis, t.and_value, t.whenever) == ("heads", 32, "kv", "float8_e4m3fn", True)
    assert t.text().startswith("fails whenever heads = 32 and kv = float8_e4m3fn (2 of 2 cases; 0 of 10 others)")
    t = trigger(_results(lambda p: p["heads"] == 32), "k", "reference")  # one axis suffices: no second
    assert (t.axis, t.value, t.and_axis, t.whenever) == ("heads", 32, None, True) and t.to_json()["and_axis"] is None
    one = trigger(_results(lambda p: p["heads"] == 32 and p["kv"] == "float8_e4m3fn" and p["page"] == 1), "k", "reference")
    assert one.and_axis is None  # a single failing case: a pair is never named from one case
    assert trigger(_results(lambda p: False), "k", "reference") is None


def test_the_trigger_skips_cases_the_backend_did_not_run_in_a_failing_layout():
    """A case of a failing layout without the backend (dropped after its skips, or run by a worker
    with other backends) counts neither way, and does not stop the sweep."""
    from refmla.sweep.report import CaseResult, CheckOutcome, trigger

    cases = _results(lambda p: p["heads"] == 32)
    other = CaseResult(len(cases), "decode", {"heads": 32, "kv": "bfloat16", "page": 1}, {})
    other.outcomes["aiter"] = {"reference": CheckOutcome("reference", "fail")}  # no "k" here
    t = trigger([*cases, other], "k", "reference")
    assert (t.axis, t.value, t.cases_with) == ("heads", 32, 4)


def test_the_trigger_reads_the_failing_layouts_and_what_the_shrink_left():
    """The heads32 run of this round: one failing block-table case at 32 heads, length 1023, and a
    passing case at 32 heads in the sparse layout (another kernel under the same name). The sparse
    case does not count against heads = 32; the shrink took the length to 2 and the batch to 1
    while the case kept failing, so neither is the trigger; what the cases cannot tell apart is said."""
    from refmla.sweep.report import CaseResult, CheckOutcome, trigger
    from refmla.sweep.run import shrunk_away

    points = [("block_table", {"heads": 32, "length": "1023", "batch": 8, "splits": "16"}, "fail"),
              ("block_table", {"heads": 16, "length": "page", "batch": 1, "splits": "8"}, "pass"),
              ("block_table", {"heads": 4, "length": "1", "batch": 64, "splits": "2"}, "pass"),
              ("sparse", {"heads": 32, "length": "2", "batch": 8, "splits": "none"}, "pass"),
              ("sparse", {"heads": 4, "length": "1023", "batch": 3, "splits": "none"}, "pass")]  # fmt: skip
    cases = []
    for i, (layout, point, status) in enumerate(points):
        res = CaseResult(i, layout, point, {})
        res.outcomes["triton"] = {"reference": CheckOutcome("reference", status)}
        cases.append(res)
    away = shrunk_away(["requests 8 -> 4", "request 0 length 1023 -> 2", "request 0 context 9 -> 4"])
    assert away == {"batch", "length"}
    t = trigger(cases, "triton", "reference", away)
    assert (t.axis, t.value, t.whenever) == ("heads", 32, True)  # not 1 of 2: the sparse case is another kernel
    assert t.ties == ["splits = 16"] and "as well: splits = 16" in t.text()
    assert (t.cases_with, t.cases_elsewhere) == (1, 2)  # the two passing block-table cases only
    plain = trigger(cases, "triton", "reference")  # without the shrink's word, length and batch tie too
    assert {"length = 1023", "batch = 8"} <= set(plain.ties) | {f"{plain.axis} = {plain.value}"}


def test_space_values_and_cases():
    assert [length_of(v, 16, 2) for v in ("0", "page-1", "page+1", "32k-1", "32k+1", "4097")] == [0, 15, 17, 63, 65, 4097]
    with pytest.raises(ValueError, match="heads"):
        restrict("decode", ["heads=5"])
    with pytest.raises(ValueError, match="unknown axis"):
        restrict("decode", ["nope=1"])
    point = {"heads": 16, "page": 64, "length": "page+1", "batch": 3, "qlen": 3, "kv": "float8_e4m3fnuz", "cap": 30.0}
    case = case_of("verify", point, seed=1, index=0)
    assert case.seq_lens[0] == 65 and len(case.seq_lens) == 3 and min(case.seq_lens) >= 3
    assert case.draft_token_num == 3 and case.k_scale != 1 and case.v_scale != 1 and case.logit_cap == 30.0
    assert case_of("verify", point, seed=1, index=0) == case != case_of("verify", point, seed=2, index=0)


def test_cli_reference_json_and_bad_flags(tmp_path, capsys):
    rc = main(["sweep", "--backend", "reference", "--budget", "1", "--json", "--out", str(tmp_path),
               "--space", "heads=4", "--space", "batch=1,2", "--space", "length=1,page+1"])  # fmt: skip
    rep = json.loads(capsys.readouterr().out)
    assert rc == 0 and rep["exit_code"] == 0 and rep["cases"]
    counts = rep["backends"]["reference"]["counts"]
    assert counts["reference"].get("pass") == len(rep["cases"]) and counts["nan_fill"] == {"n/a": len(rep["cases"])}
    for argv in (["--space", "heads=5"], ["--repeat", "1"], ["--budget", "0"], ["--backend", "nope"]):
        assert _exit_code(["sweep", "--budget", "1", *argv]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "Traceback" not in err[0]


def _exit_code(argv) -> int:
    try:
        return main(argv)
    except SystemExit as e:  # argparse's usage errors
        return int(e.code)


def test_jobs_give_the_same_cases_as_serial(tmp_path):
    cfg = dict(backends=["reference"], budget=600, out=str(tmp_path), max_cases=3, layouts=["decode"],
               space=["heads=4", "batch=1,2", "length=1,page+1"])  # fmt: skip
    serial = run_sweep(SweepConfig(**cfg))
    parallel = run_sweep(SweepConfig(**cfg, jobs=2))
    assert [c.params for c in serial.cases] == [c.params for c in parallel.cases[:3]]
    assert all(c.outcomes["reference"]["reference"].status == "pass" for c in parallel.cases)


def test_jobs_pin_one_gpu_per_worker_where_several_are_visible(tmp_path, monkeypatch):
    """--jobs N on a machine with several GPUs: worker i sees GPU i mod their count alone (as
    pytest-xdist users pin theirs), in the variable's own spelling; one GPU or none: untouched."""
    import os

    import torch

    from refmla.sweep.run import visible_gpus

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("HIP_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert visible_gpus() == ("", [])
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    var = "HIP_VISIBLE_DEVICES" if torch.version.hip else "CUDA_VISIBLE_DEVICES"
    assert visible_gpus() == (var, ["0", "1", "2", "3"])
    monkeypatch.setenv(var, "3,5")  # already narrowed by the user: the workers share out those two
    seen = tmp_path / "seen"
    seen.mkdir()
    run_sweep(SweepConfig(backends=["reference"], budget=600, out=str(tmp_path / "out"), max_cases=2, jobs=2,
                          layouts=["decode"], space=["heads=4", "batch=1", "length=1"],
                          setup=f"sweep_standins:record_gpu:{seen}"))  # fmt: skip
    workers = [json.loads(f.read_text())[var] for f in seen.iterdir() if f.name != str(os.getpid())]
    assert sorted(workers) == ["3", "5"], workers


def test_a_worker_that_dies_costs_its_case_only(tmp_path, monkeypatch):
    """--jobs: a process death outside the kernel's isolation is that case's ``error`` finding;
    the worker is started again and the other cases run and pass."""
    import os

    import sweep_standins

    monkeypatch.setenv("REFMLA_ISOLATE", "0")
    monkeypatch.setenv("REFMLA_TEST_SPARE_PID", str(os.getpid()))  # the shrink reruns it here: it passes
    monkeypatch.setitem(backends._CACHE, "dies_at_8_heads", sweep_standins.DiesAt8Heads())
    monkeypatch.setitem(backends._WHERE, "dies_at_8_heads", "sweep_standins:DiesAt8Heads")
    rep = run_sweep(SweepConfig(backends=["dies_at_8_heads"], budget=600, out=str(tmp_path), max_cases=6, jobs=2,
                                layouts=["decode"], space=["heads=8,4", "batch=1", "length=1", "page=1,16"],
                                checks=["reference"], max_shrink=0, setup="sweep_standins:install_dies"))  # fmt: skip
    status = {c.index: (c.point["heads"], c.outcomes["dies_at_8_heads"]["reference"]) for c in rep.cases}
    assert len(status) >= 6 and {h for h, _ in status.values()} == {8, 4}, status  # (the cases in flight finish)
    for heads, o in status.values():
        assert (o.status, "died" in o.detail) == (("error", True) if heads == 8 else ("pass", False)), (heads, o)
    (f,) = rep.findings
    assert f.check == "reference" and f.failing_cases == sum(h == 8 for h, _ in status.values())


@pytest.mark.slow
@pytest.mark.parametrize("plant", sorted(planted_sweep.SWEEP_PLANTS))
def test_planted_fault_found_shrunk_and_replays_diverged(plant, tmp_path, monkeypatch, capsys):
    """The quick sweep of the plant's space (its expected check only) finds it; SGLang's own kernel
    passes the same first case."""
    check = planted_sweep.EXPECTED[plant]
    monkeypatch.setitem(backends._CACHE, "triton", planted_sweep.SweepPlant(plant))
    cfg = SweepConfig(backends=["triton"], budget=600, out=str(tmp_path), layouts=["decode"],
                      max_cases=2 if plant == "heads32" else 1, space=planted_sweep.QUICK_SPACE[plant],
                      checks=[check], max_shrink=2)  # fmt: skip
    rep = run_sweep(cfg)
    (f,) = [f for f in rep.findings if f.check == check]
    assert rep.exit_code == 1 and f.backend == "triton" and f.capture and f.replay_verdict == "diverged", f
    first = next(c for c in rep.cases if c.index == f.first_case)
    assert len(f.shrunk["seq_lens"]) <= len(first.params["seq_lens"]) and f.shrunk["num_heads"] <= first.params["num_heads"]
    if plant == "heads32":  # the 8-head case passes: the walk names the axis, the shrink keeps 32 heads
        assert (f.trigger.axis, f.trigger.value, f.trigger.whenever) == ("heads", 32, True)
        assert f.shrunk["num_heads"] == 32
    monkeypatch.setitem(backends._CACHE, "triton", TritonBackend())  # SGLang's kernel as installed
    outcomes, _ = CaseChecks(case_of("decode", first.point, 0, first.index), cfg.options()).run("triton", (check,))
    assert outcomes[check].status == "pass", outcomes[check].detail
    if plant == "heads32":  # `refmla replay` on the capture: the captured (planted) output diverges
        capsys.readouterr()
        assert main(["replay", f.capture, "--backend", "triton"]) == 1
        assert "diverged" in capsys.readouterr().out


@pytest.mark.parametrize("layout", ["decode", "block_table"])
def test_a_kernel_that_raises_is_a_finding_shrunk_with_a_capture_replay_reruns(layout, tmp_path, monkeypatch, capsys):
    """A kernel that raises on a shape: an ``error`` finding under the first check, shrunk while it
    still raises, written as the shrunk case's inputs (no output: there is none), and `refmla
    replay` on that capture with the backend reruns it: diverged, the error named; never "intermittent"."""
    import sweep_standins

    name = "triton"  # in this process only: `refmla replay --backend triton` runs it too
    monkeypatch.setitem(backends._CACHE, name, sweep_standins.RaisesAt8Heads())
    rep = run_sweep(SweepConfig(backends=[name], budget=600, out=str(tmp_path), max_cases=2, layouts=[layout],
                                space=["heads=8,4", "batch=3", "length=page+1", "page=16", "kv=bfloat16", "cap=0",
                                       "splits=1", "table=shuffled", "null=nan"],
                                max_shrink=6))  # fmt: skip
    (f,) = rep.findings
    assert f.check == "reference" and f.failing_cases == 1 and "planted at 8 heads" in f.detail, f
    assert (f.trigger.axis, f.trigger.value, f.trigger.whenever) == ("heads", 8, True)
    assert f.shrunk["num_heads"] == 8 and len(f.shrunk["seq_lens"]) == 1 and f.shrink_steps, f
    assert "intermittent" not in f.shrunk_detail and f.capture and f.replay_verdict == "diverged", f
    capsys.readouterr()
    assert main(["replay", f.capture, "--backend", name]) == 1
    assert "planted at 8 heads" in capsys.readouterr().out


HOSTILE = ["heads=16,4", "batch=1,3", "length=0,page+1,32k-1", "page=1,16", "kv=bfloat16,float8_e4m3fnuz", "cap=0,30",
           "qlen=1,2", "splits=1,past"]  # fmt: skip


def test_refmlas_rewrite_of_aiters_reference_passes_a_hostile_sweep(tmp_path, monkeypatch):
    """refmla's own rewrite of aiter's torch reference (refmla.synthetic.benign.fp32_einsum, written
    here: a second formulation, not an independent kernel) as a backend: hostile points of decode
    and verify (empty and page-edge requests, fp8 with scales != 1, a logit cap, empty splits), no
    false alarm under any check that applies."""
    import sweep_standins

    monkeypatch.setitem(backends._CACHE, sweep_standins.NAME, sweep_standins.AiterTorchRef())
    monkeypatch.setitem(backends._WHERE, sweep_standins.NAME, "sweep_standins:AiterTorchRef")
    rep = run_sweep(SweepConfig(backends=[sweep_standins.NAME], budget=600, out=str(tmp_path), max_cases=8,
                                layouts=["decode", "verify"], space=HOSTILE, max_shrink=0))  # fmt: skip
    counts = rep.backends[sweep_standins.NAME].counts
    assert rep.exit_code == 0 and len(rep.cases) == 8, [f.detail for f in rep.findings]
    assert counts["reference"] == {"pass": 8} and counts["repeat"] == {"pass": 8}, counts
    assert {c.layout for c in rep.cases} == {"decode", "verify"}  # every value of the hostile axes was met
    assert {c.point["kv"] for c in rep.cases} == {"bfloat16", "float8_e4m3fnuz"}
    assert {c.point["cap"] for c in rep.cases} == {0.0, 30.0} and {c.point["length"] for c in rep.cases} >= {"0", "page+1"}


@pytest.mark.skipif(not os.environ.get("REFMLA_AITER_REPO"), reason="no aiter checkout (set REFMLA_AITER_REPO)")
def test_a_correct_kernel_not_written_here_passes_a_sweep(tmp_path, monkeypatch):
    """aiter's own torch reference (op_tests/test_mla.py::torch_mla_extend, loaded at run time from
    the checkout REFMLA_AITER_REPO names: code not written here) as a backend on hostile decode
    points it takes (bf16, no scales, no cap: empty and page-edge requests, empty splits, heads
    16 and 4): no false alarm, its output judged against the reference."""
    import sweep_standins

    monkeypatch.setitem(backends._CACHE, sweep_standins.PEER, sweep_standins.AiterPeerRef())
    monkeypatch.setitem(backends._WHERE, sweep_standins.PEER, "sweep_standins:AiterPeerRef")
    space = [*HOSTILE, "kv=bfloat16", "cap=0"]
    rep = run_sweep(SweepConfig(backends=[sweep_standins.PEER], budget=600, out=str(tmp_path), max_cases=6,
                                layouts=["decode"], space=space, max_shrink=0))  # fmt: skip
    counts = rep.backends[sweep_standins.PEER].counts
    assert rep.exit_code == 0 and len(rep.cases) == 6, [f.detail for f in rep.findings]
    assert counts["reference"] == {"pass": 6} and counts["repeat"] == {"pass": 6}, counts
    assert {c.point["length"] for c in rep.cases} >= {"0", "page+1"} and {c.point["heads"] for c in rep.cases} == {16, 4}


@pytest.mark.slow
@pytest.mark.skipif(not backends.get_backend("flex").availability()[0], reason="flex unavailable")
def test_flex_passes_a_sweep(tmp_path, monkeypatch):
    """PyTorch's flex_attention compiled by Inductor (a kernel not written here): no false alarm
    (in-process, as the README's known limit advises for flex under load)."""
    monkeypatch.setenv("REFMLA_ISOLATE", "0")
    rep = run_sweep(SweepConfig(backends=["flex"], budget=600, out=str(tmp_path), max_cases=3, layouts=["decode"],
                                space=HOSTILE, max_shrink=0))  # fmt: skip
    counts = rep.backends["flex"].counts
    assert rep.exit_code == 0 and len(rep.cases) == 3, [f.detail for f in rep.findings]
    assert counts["reference"].get("pass", 0) == 3 and counts["repeat"].get("pass", 0) == 3, counts


def test_the_plants_edit_one_line_each():
    assert len(set(planted_sweep.SWEEP_PLANTS)) == len(planted_sweep.EXPECTED) == 4
    for func, old, new in planted_sweep.SWEEP_PLANTS.values():
        assert old != new and func.startswith("_fwd_")
    assert set(itertools.chain(planted_sweep.EXPECTED.values())) == {"reference", "nan_fill", "repeat"}
