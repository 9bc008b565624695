"""The sweep's nan_fill check names a value the kernel never wrote only when the fill decides it:
a NaN that appears once at random is ``nondeterministic``; a kernel that allocates a buffer inside
(aiter's split partials) is said not to have had it poisoned."""

from __future__ import annotations

import pytest

import refmla.backends as backends
from refmla.backends.base import Backend
from refmla.sweep import SweepConfig, run_sweep

SPACE = ["heads=4", "batch=2", "length=page+1", "page=16", "kv=bfloat16", "cap=0", "splits=1"]


class FillsBuffers(Backend):
    """The fp64 reference as a kernel that takes its output buffer from the caller (a test stand-in)."""

    fills_buffers = True
    calls = 0

    def availability(self):
        return True, "a test stand-in"

    def run(self, cap, opts):
        type(self).calls += 1
        res = backends.get_backend("reference").run(cap, opts)
        res.out = self.leave(res.out.clone(), opts)
        return res


class LeavesRow0(FillsBuffers):
    """Never writes request 0's row: it holds what the caller's buffer held (its fill)."""

    name = "leaves_row_0"

    def leave(self, out, opts):
        out[0] = 0.0 if opts.buffer_fill is None else opts.buffer_fill
        return out


class NanOnce(FillsBuffers):
    """Writes every row, but one value comes out NaN on its second run only, whatever the fill."""

    name = "nan_once"

    def leave(self, out, opts):
        if type(self).calls == 2:
            out[1, 0, 0] = float("nan")
        return out


@pytest.mark.parametrize("kind, expected", [(LeavesRow0, "unwritten"), (NanOnce, "nondeterministic")])
def test_the_fill_decides_a_nan_fill_finding(kind, expected, tmp_path, monkeypatch):
    monkeypatch.setitem(backends._CACHE, kind.name, kind())
    monkeypatch.setitem(backends._WHERE, kind.name, f"test_sweep_nanfill:{kind.__name__}")
    monkeypatch.setattr(FillsBuffers, "calls", 0)
    rep = run_sweep(SweepConfig(backends=[kind.name], budget=600, out=str(tmp_path), max_cases=1, layouts=["decode"],
                                space=SPACE, checks=["nan_fill"], max_shrink=0))  # fmt: skip
    (case,) = rep.cases
    o = case.outcomes[kind.name]["nan_fill"]
    assert o.status == "fail" and o.data["kind"] == expected, o.detail
    assert ("never wrote" in o.detail) == (expected == "unwritten") and ("nondeterministic" in o.detail) == (
        expected == "nondeterministic")


def test_aiters_partials_are_said_not_poisoned(standin, tmp_path):
    """aiter allocates its split partials inside mla_decode_fwd: the nan_fill check that passes on
    the output it is handed says those were not poisoned."""
    rep = run_sweep(SweepConfig(backends=["aiter"], budget=600, out=str(tmp_path), max_cases=1, layouts=["decode"],
                                space=["heads=16", "batch=3", "length=page+1", "page=16", "kv=bfloat16", "cap=0",
                                       "splits=2"], checks=["nan_fill"], max_shrink=0))  # fmt: skip
    o = rep.cases[0].outcomes["aiter"]["nan_fill"]
    assert o.status == "pass" and "not poisoned: the split partials" in o.detail, o.detail
