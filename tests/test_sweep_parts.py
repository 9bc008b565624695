"""The dense sweep judges a kernel as replay judges it: its lse and its split partials too, wherever
it returns them, at the arithmetic it declares. Two faults that leave the output right, planted in
real kernels (tests/planted_parts.py), are found by a sweep within 300 s on CPU, shrunk, and written
as a capture whose replay (rerunning the kernel) says diverged; the unplanted kernels pass the same
cases with every part judged."""

from __future__ import annotations

import time

import pytest

import planted_parts
import refmla.backends as backends
from refmla.sweep import SweepConfig, run_sweep
from refmla.sweep.cases import case_of
from refmla.sweep.checks import CaseChecks

pytestmark = [pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:divide by zero encountered:RuntimeWarning")]
LIMIT_S = 300  # the bound for the whole sweep, walk and shrink


@pytest.mark.parametrize("plant", sorted(planted_parts.BACKEND))
def test_a_wrong_part_with_a_right_output_is_found_by_a_sweep(plant, tmp_path, monkeypatch):
    name, layout, part = planted_parts.BACKEND[plant], planted_parts.LAYOUT[plant], planted_parts.PART[plant]
    stock = backends.get_backend(name)
    ok, why = stock.availability()
    if not ok:
        pytest.skip(f"{name} unavailable: {why}")
    monkeypatch.setitem(backends._CACHE, name, planted_parts.planted(plant))
    t0 = time.monotonic()
    cfg = SweepConfig(backends=[name], budget=60, out=str(tmp_path), layouts=[layout], checks=["reference"],
                      max_shrink=3, repeat=2)  # fmt: skip
    rep = run_sweep(cfg)
    took = time.monotonic() - t0
    (f,) = rep.findings
    assert took < LIMIT_S and rep.exit_code == 1 and f.check == "reference", (took, f)
    first = next(c for c in rep.cases if c.layout == f.layout and c.index == f.first_case)
    outcome = first.outcomes[name]["reference"]
    assert outcome.data["failed_parts"] == [part], outcome.detail  # the output itself passed
    assert outcome.data["comparison"]["passed"] is True and outcome.data[part]["status"] == "fail"
    assert f.capture and f.replay_verdict == "diverged", f  # its replay reruns the planted kernel
    monkeypatch.setitem(backends._CACHE, name, stock)
    case = case_of(layout, first.point, cfg.seed, first.index)
    outcomes, _ = CaseChecks(case, cfg.options(), 2).run(name, ("reference",))
    o = outcomes["reference"]
    assert o.status == "pass" and o.data[part]["status"] == "pass", o.detail  # the stock kernel: every part judged
