"""The sweep keeps its budget (within 10 %, the last case allowed to finish; shrinking included),
its progress counts cases and never passes its total, and the Triton interpreter's own numpy
warnings stay out of the output."""

from __future__ import annotations

import re
import subprocess
import sys
import time

import pytest

import refmla.backends as backends
from refmla.backends.base import Backend
from refmla.sweep import SweepConfig, run_sweep
from refmla.sweep.cases import case_of

SPACE = ["heads=8,4", "batch=1,2", "length=1,page+1", "page=16"]


class Slow(Backend):
    """The fp64 reference, half a second slower each run; ``fails_at_8`` fails (raises) at 8 heads."""

    name = "slow_reference"
    fails_at_8 = False

    def availability(self):
        return True, "the reference, 0.5 s slower a run (a test stand-in)"

    def run(self, cap, opts):
        time.sleep(0.5)
        if self.fails_at_8 and cap.q.shape[1] == 8:
            raise RuntimeError("planted at 8 heads")
        return backends.get_backend("reference").run(cap, opts)


class SlowFailing(Slow):
    name = "slow_failing"
    fails_at_8 = True


@pytest.mark.parametrize("kind", [Slow, SlowFailing])
def test_the_budget_is_kept_shrinking_included_and_progress_counts_cases(kind, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(backends._CACHE, kind.name, kind())
    monkeypatch.setitem(backends._WHERE, kind.name, f"test_sweep_budget:{kind.__name__}")
    budget = 8.0
    t0 = time.monotonic()
    rep = run_sweep(SweepConfig(backends=[kind.name], budget=budget, out=str(tmp_path), layouts=["decode"],
                                space=SPACE, repeat=2, max_shrink=50))  # fmt: skip
    took = time.monotonic() - t0
    last = max(sum(c.kernel_seconds.values()) + sum(c.reference_seconds.values()) for c in rep.cases)
    assert took <= 1.1 * budget + last, (took, last, rep.walk_seconds, rep.shrink_seconds)
    assert (rep.exit_code, bool(rep.findings)) == ((1, True) if kind is SlowFailing else (0, False))
    err = capsys.readouterr().err
    counts = [(int(a), int(b)) for a, b in re.findall(r"^\[(\d+)/(\d+)\] \d+ cases", err, re.M)]
    assert [a for a, _ in counts] == list(range(1, len(rep.cases) + 1)), err  # one line a case
    assert all(a <= b for a, b in counts), counts  # never past its total


@pytest.mark.slow
def test_the_interpreters_warnings_stay_out_of_the_output(tmp_path):
    """A sweep of SGLang's kernels (dense and sparse) in a fresh process: no numpy RuntimeWarning
    of the interpreter's masked-off lanes on stderr."""
    if not backends.get_backend("triton").availability()[0]:
        pytest.skip("SGLang's Triton kernel unavailable")
    argv = [sys.executable, "-m", "refmla", "sweep", "--backend", "triton", "--budget", "20", "--out", str(tmp_path),
            "--layout", "decode", "--layout", "sparse", "--space", "heads=16", "--space", "batch=1,3",
            "--space", "length=0,1,page+1,64,65", "--allow-skip"]  # fmt: skip
    got = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert got.returncode in (0, 1), got.stderr[-2000:]
    assert "RuntimeWarning" not in got.stderr and "encountered" not in got.stderr, got.stderr[-2000:]


class FakeClock:
    """The budget's clock (refmla.sweep.budget.now) under the test's hand: only the stand-in kernels move it."""

    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class Priced(Backend):
    """The fp64 reference, costing (on the fake clock) ``base`` + ``per`` seconds per attended
    element (heads x (tokens + 1) per request, counted here from the capture) each run."""

    name = "priced"
    base, per = 2.0, 1e-3
    clock: FakeClock

    def availability(self):
        return True, "the reference, priced on a fake clock (a test stand-in)"

    def run(self, cap, opts):
        elements = cap.q.shape[1] * int((cap.seq_lens.long() + 1).sum())
        self.clock.t += self.base + self.per * elements
        return backends.get_backend("reference").run(cap, opts)


def _priced(monkeypatch, kind=Priced):
    import refmla.sweep.budget as budget

    clock = FakeClock()
    monkeypatch.setattr(budget, "now", clock)
    monkeypatch.setenv("REFMLA_ISOLATE", "0")  # in-process: the stand-in moves this process's fake clock
    stub = kind()
    stub.clock = clock
    monkeypatch.setitem(backends._CACHE, kind.name, stub)
    monkeypatch.setitem(backends._WHERE, kind.name, f"test_sweep_budget:{kind.__name__}")
    return clock


def test_no_case_starts_that_its_predicted_cost_says_cannot_finish(tmp_path, monkeypatch):
    """Cheap (1 token) and dear (4097 tokens) points alternate; each run costs 2 s + 1 ms per
    attended element on a fake clock, two runs a case (reference, repeat). Once two sizes are
    timed the prediction is exact: a dear point that would pass the budget is not started, a cheap
    one after it is, and the walk ends within its budget, nothing cut off."""
    clock = _priced(monkeypatch)
    start = clock.t
    rep = run_sweep(SweepConfig(backends=["priced"], budget=200, out=str(tmp_path), layouts=["decode"], repeat=2,
                                checks=["reference", "repeat"], max_shrink=0,
                                space=["heads=4", "batch=1", "length=1,4097", "page=1", "splits=1", "kv=bfloat16", "cap=0"]))  # fmt: skip
    lengths = [c.params["seq_lens"][0] for c in rep.cases]
    assert {1, 4097} <= set(lengths) and rep.exit_code == 0 and rep.cut_off == 0, lengths
    assert clock.t - start <= 200, (clock.t - start, lengths)  # the budget kept: no case ran past it
    assert rep.not_started.get("decode", 0) >= 1  # a dear point refused ...
    dear = 2 * (2 + 1e-3 * 4 * 4098)
    assert clock.t - start > 200 - dear  # ... only where it would not have fitted (cheap ones ran on)
    assert all(o.status == "pass" for c in rep.cases for o in c.outcomes["priced"].values())


class Stalls(Priced):
    """Its first run costs 300 fake seconds: the case meets the deadline mid-way."""

    name = "stalls"
    base, per = 300.0, 0.0


def test_a_case_past_the_deadline_is_not_run_budget_never_a_pass_or_a_finding(tmp_path, monkeypatch, capsys):
    _priced(monkeypatch, Stalls)
    rep = run_sweep(SweepConfig(backends=["stalls"], budget=100, out=str(tmp_path), layouts=["decode"], repeat=2,
                                checks=["reference", "repeat"], space=["heads=4", "batch=1", "length=1"]))  # fmt: skip
    (case,) = rep.cases
    outcomes = case.outcomes["stalls"]
    assert {o.status for o in outcomes.values()} == {"not run"}, outcomes
    assert all(o.detail.startswith("not run: budget") for o in outcomes.values())
    assert rep.cut_off == 1 and rep.exit_code == 0 and not rep.findings and rep.backends["stalls"].cases == 0
    assert rep.to_json()["cut_off"] == 1
    from refmla.render.sweep import render_sweep

    text = render_sweep(rep)
    assert "1 case(s) cut off" in text and "not run" in text, text


def test_a_running_kernel_is_killed_at_the_deadline(tmp_path, monkeypatch):
    """In its child process (isolation), a kernel that would run 100 s is killed at budget x 1.05:
    its case is ``not run: budget``, not an error finding, and the sweep does not wait for it."""
    import sweep_standins

    monkeypatch.setenv("REFMLA_TEST_LONG_AT_8", "1")
    monkeypatch.setenv("REFMLA_ISOLATE", "1")  # the suite runs kernels in-process (tests/conftest.py): not this one
    monkeypatch.setitem(backends._CACHE, "sleeps_at_8_heads", sweep_standins.SleepsAt8Heads())
    monkeypatch.setitem(backends._WHERE, "sleeps_at_8_heads", "sweep_standins:SleepsAt8Heads")
    t0 = time.monotonic()
    rep = run_sweep(SweepConfig(backends=["sleeps_at_8_heads"], budget=6, out=str(tmp_path), layouts=["decode"],
                                repeat=2, checks=["reference"], space=["heads=8", "batch=1", "length=1"]))  # fmt: skip
    took = time.monotonic() - t0
    assert took < 50, took  # killed, not waited for (the budget's 10 % is the benchmark's, tools/bench_sweep.py)
    (case,) = rep.cases
    assert case.outcomes["sleeps_at_8_heads"]["reference"].status == "not run" and not rep.findings


@pytest.mark.slow
def test_jobs_keep_the_budget_and_give_the_serial_results(tmp_path, monkeypatch):
    """--jobs 2 with --budget: worker start-up included, the sweep ends within 10 % of its budget
    (a 100 s kernel at 8 heads is cut off in its worker: ``not run``), and every case it ran to the
    end has the outcomes of the same case in a serial sweep (where 8 heads take 0.2 s)."""
    cfg = dict(backends=["sleeps_at_8_heads"], out=str(tmp_path), layouts=["decode"], repeat=2,
               checks=["reference", "repeat"], max_shrink=0, setup="sweep_standins:install_sleeper",
               space=["heads=8,4", "batch=1,2", "length=1,page+1", "page=1,16"])  # fmt: skip
    import sweep_standins

    monkeypatch.setitem(backends._CACHE, "sleeps_at_8_heads", sweep_standins.SleepsAt8Heads())
    monkeypatch.setitem(backends._WHERE, "sleeps_at_8_heads", "sweep_standins:SleepsAt8Heads")
    monkeypatch.setenv("REFMLA_TEST_LONG_AT_8", "1")  # (the spawned workers inherit it)
    monkeypatch.setenv("REFMLA_ISOLATE", "1")  # the workers' kernels in their children: killable at the deadline
    budget = 30.0
    t0 = time.monotonic()
    parallel = run_sweep(SweepConfig(**cfg, budget=budget, jobs=2))
    took = time.monotonic() - t0
    assert took < 90, took  # the 100 s kernels killed in their workers, not waited for (10 %: tools/bench_sweep.py)
    status = {c.index: {o.status for o in c.outcomes["sleeps_at_8_heads"].values()} for c in parallel.cases}
    cut = [c for c in parallel.cases if c.point["heads"] == 8]
    assert cut and all(status[c.index] == {"not run"} for c in cut), status
    done = {c.index: c for c in parallel.cases if status[c.index] != {"not run"}}
    assert done and all(c.point["heads"] == 4 for c in done.values()), status
    monkeypatch.delenv("REFMLA_TEST_LONG_AT_8")
    serial = run_sweep(SweepConfig(**cfg, budget=600, max_cases=max(done) + 1))
    by_index = {c.index: c for c in serial.cases}
    for i, c in done.items():
        want = {k: (o.status, o.detail) for k, o in by_index[i].outcomes["sleeps_at_8_heads"].items()}
        got = {k: (o.status, o.detail) for k, o in c.outcomes["sleeps_at_8_heads"].items()}
        assert got == want and c.params == by_index[i].params, (i, got, want)


def test_the_cost_model_and_the_work_it_is_fitted_on():
    """seconds = overhead + rate x work, least squares; one size seen: through the origin; none: no
    prediction. Work counts heads in 16-head tiles and a fixed cost per split of each query row, so
    a batch of 64 short requests at 4 heads (64 programs) outweighs one 128-token request at 16."""
    from refmla.sweep.budget import ROW_TOKENS, CostModel, work
    from refmla.sweep.cases import with_splits

    m = CostModel()
    assert m.predict("k", "decode", 10) is None and m.case_seconds(["k"], "decode", 10) == 0
    m.add("k", "decode", 100, 3.0)
    assert m.predict("k", "decode", 200) == pytest.approx(6.0)  # one size: the rate through the origin
    m.add("k", "decode", 300, 7.0)
    assert m.predict("k", "decode", 200) == pytest.approx(5.0) and m.predict("k", "sparse", 200) is None
    one = case_of("decode", {"heads": 16, "page": 1, "length": "128", "batch": 1, "splits": "1", "kv": "bfloat16", "cap": 0.0}, 0, 0)
    many = case_of("decode", {"heads": 4, "page": 1, "length": "1", "batch": 64, "splits": "1", "kv": "bfloat16", "cap": 0.0}, 0, 0)
    assert work(one) == 16 * (128 + ROW_TOKENS) and work(many) > 16 * 64 * ROW_TOKENS > work(one)
    assert work(with_splits(one, (4,))) == 16 * (128 + 4 * ROW_TOKENS)


SLOW_SETUP: list = []  # the fake clock a test's setup moves


def slow_setup() -> None:
    """A sweep's ``setup`` that takes 150 s of the fake clock (imports, a backend's start-up)."""
    SLOW_SETUP[0].t += 150.0


def test_the_budget_counts_from_the_sweeps_start(tmp_path, monkeypatch):
    """Set-up time (a setup function, the backends' imports and availability) is in the budget:
    after 150 s of it, a 200 s sweep walks what fits in the 50 s left."""
    clock = _priced(monkeypatch)
    monkeypatch.setattr(sys.modules[__name__], "SLOW_SETUP", [clock])
    start = clock.t
    rep = run_sweep(SweepConfig(backends=["priced"], budget=200, out=str(tmp_path), layouts=["decode"], repeat=2,
                                checks=["reference", "repeat"], max_shrink=0, setup=f"{__name__}:slow_setup",
                                space=["heads=4", "batch=1", "length=1", "page=1", "splits=1", "kv=bfloat16", "cap=0"]))  # fmt: skip
    assert rep.cases and clock.t - start <= 200 + 2 * (2 + 1e-3 * 8), (clock.t - start, len(rep.cases))
