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
