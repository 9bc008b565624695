"""`refmla replay --repeat N` (issue 31): each kernel backend run N times on the same inputs and
compared bit for bit; a backend whose runs differ is the finding ``nondeterministic`` (exit 1) even
when every run is within the tolerance (aiter #4420: NaN sometimes on byte-identical inputs)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from hostile import run_cli, write_small
from refmla.backends.base import Backend, BackendResult
from refmla.repeat import compare_runs


class Flaky(Backend):
    """A stand-in kernel: the capture's own ``out`` (a correct kernel's), except on call ``bad_call``
    (counted in a file: each run may be a child process of its own), where it writes ``how``."""

    def __init__(self, counter: Path, bad_call: int | None, how: str = "nan"):
        self.counter, self.bad_call, self.how, self.name = counter, bad_call, how, "flaky"

    def availability(self):
        return True, "stand-in"

    def run(self, cap, opts):
        n = int(self.counter.read_text()) if self.counter.exists() else 0
        self.counter.write_text(str(n + 1))
        out = cap.out.clone()
        if n == self.bad_call:
            if self.how == "nan":
                out[0, 0, 3] = math.nan
            else:  # one element one ulp on: still within the tolerance
                bits = out.view(torch.int16 if out.element_size() == 2 else torch.int32)
                bits[0, 0, 3] += 1
        return BackendResult(out=out, info={"stand_in": self.how})


def register(monkeypatch, backend: Backend) -> None:
    import refmla.backends as backends
    import refmla.cli.replay as cli_replay
    import refmla.pipeline as replay

    monkeypatch.setitem(backends._CACHE, "flaky", backend)
    monkeypatch.setitem(backends._WHERE, "flaky", "tests:Flaky")
    monkeypatch.setattr(replay, "ALL_NAMES", tuple(replay.ALL_NAMES) + ("flaky",))
    monkeypatch.setattr(cli_replay, "ALL_NAMES", tuple(cli_replay.ALL_NAMES) + ("flaky",))


@pytest.fixture(scope="module")
def capture(tmp_path_factory):
    return str(write_small(tmp_path_factory.mktemp("repeat") / "a.safetensors"))


@pytest.mark.parametrize("bad_call,how", [(None, "nan"), (3, "nan"), (2, "ulp")])
def test_replay_repeat_5_flags_a_backend_whose_runs_differ(monkeypatch, tmp_path, capture, bad_call, how):
    register(monkeypatch, Flaky(tmp_path / "calls", bad_call, how))
    code, out, err = run_cli("replay", capture, "--backend", "flaky", "--repeat", "5", "--json", "--no-explain")
    assert (tmp_path / "calls").read_text() == "5"  # five runs of the kernel, no more
    entry = json.loads(out)["backends"]["flaky"]
    rep = entry["info"]["repeat"]
    assert rep["runs"] == 5
    if bad_call is None:
        assert code == 0 and entry["status"] == "pass" and rep["deterministic"], (code, entry)
        assert rep["differing_runs"] == 0 and rep["worst_tensor"] is None
        return
    assert code == 1 and entry["status"] == "fail", (code, entry)
    assert "nondeterministic" in entry["reason"]
    assert rep["differing_runs"] == 1 and rep["differing_elements"] == 1 and not rep["deterministic"]
    assert rep["worst_tensor"] == "out" and rep["worst_index"] == [0, 0, 3]
    if how == "nan":
        assert rep["worst_values"][1] == "nan"
    else:  # within the tolerance, yet a finding: the comparator alone would pass it
        assert entry["max_abs_err"] is not None and all(isinstance(v, float) for v in rep["worst_values"])


def test_once_by_default_and_a_bad_repeat_is_a_usage_error(monkeypatch, tmp_path, capture):
    register(monkeypatch, Flaky(tmp_path / "calls", 0))  # the first run is the bad one, but only one run
    code, out, _ = run_cli("replay", capture, "--backend", "flaky", "--json", "--no-explain")
    assert (tmp_path / "calls").read_text() == "1" and "repeat" not in json.loads(out)["backends"]["flaky"]["info"]
    for bad in ("0", "1001", "two"):
        code, out, err = run_cli("replay", capture, "--repeat", bad)
        assert code == 2 and "argument --repeat" in err, (bad, err)


def test_compare_runs_is_bitwise():
    a = torch.tensor([0.0, 1.0, math.nan])
    assert compare_runs([{"x": a}, {"x": a.clone()}]).deterministic  # NaN == NaN when the bits match
    signed = compare_runs([{"x": a}, {"x": torch.tensor([-0.0, 1.0, math.nan])}])
    assert signed.differing_runs == 1 and signed.differing_elements == 1 and signed.worst_index == (0,)
    worst = compare_runs([{"x": a}, {"x": torch.tensor([0.0, 1.5, math.nan])}, {"x": torch.tensor([0.0, 1.0, 2.0])}])
    assert worst.differing_runs == 2 and worst.worst_index == (2,) and math.isnan(worst.worst_values[0])
    with pytest.raises(ValueError):
        compare_runs([{"x": a}])


def test_the_finding_is_listed_under_info_findings(monkeypatch, tmp_path, capture):
    """docs/contract.md section 3: info.findings lists every finding, nondeterministic with info.repeat as its detail."""
    register(monkeypatch, Flaky(tmp_path / "calls", 1))
    code, out, _ = run_cli("replay", capture, "--backend", "flaky", "--repeat", "3", "--json", "--no-explain")
    info = json.loads(out)["backends"]["flaky"]["info"]
    assert code == 1 and [f["kind"] for f in info["findings"]] == ["nondeterministic"], info
    assert info["findings"][0]["detail"] == info["repeat"]


@pytest.mark.parametrize("flaky", [False, True])
def test_a_sparse_kernel_is_repeated_too(monkeypatch, tmp_path, flaky):
    """A sparse decode capture: a stand-in sparse kernel returning production's output, NaN in one of
    five runs when flaky (counted in a file: each run may be a child process), is nondeterministic."""
    from refmla.sparse import backends as sparse_backends
    from refmla.sparse.backends import PathOutput
    from refmla.sparse.make import synth_sparse

    path = tmp_path / "s.safetensors"
    synth_sparse(path, "deepseek-v4-flash-tp8")
    counter = tmp_path / "calls"

    def kernel(cap):
        n = int(counter.read_text()) if counter.exists() else 0
        counter.write_text(str(n + 1))
        out = cap.out.clone()
        if flaky and n == 3:
            out.view(-1)[5] = math.nan
        return PathOutput(out, cap.lse, "stand-in: production's output")

    monkeypatch.setitem(sparse_backends.BACKENDS, "tilelang", kernel)
    code, out, _ = run_cli("replay", str(path), "--backend", "tilelang", "--repeat", "5", "--json", "--no-explain")
    entry = json.loads(out)["backends"]["tilelang"]
    assert counter.read_text() == "5" and entry["info"]["repeat"]["runs"] == 5
    if not flaky:
        assert code == 0 and entry["status"] == "pass" and entry["info"]["repeat"]["deterministic"], entry
        return
    assert code == 1 and entry["status"] == "fail" and "nondeterministic" in entry["reason"], entry
    assert entry["info"]["repeat"]["differing_runs"] == 1 and entry["info"]["findings"][0]["kind"] == "nondeterministic"
