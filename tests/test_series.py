"""Several captures: series checks across decode steps, directory replay, the summary table, plots."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Optional

import pytest
import torch

from refmla.attended import Attended
from refmla.control import mla_control
from refmla.capture import parse_meta, write_capture
from refmla.cli import main
from refmla.batch import replay_one
from refmla.render.replay import summary_table
from refmla.results import BackendEntry, MetadataReport, ReplayReport
from refmla.scales import Scales
from refmla.series import series_checks

DV, DR = 32, 8
D = DV + DR

META = dict(mode="decode", backend="unknown", kv_lora_rank=512, qk_rope_head_dim=64, sm_scale=0.1, logit_cap=0.0,
            page_size=1)  # fmt: skip


@dataclass
class Series:
    """Decode steps of one layer on one rank: each request's rows live at fixed pool slots and
    every step appends one token."""

    prompt: dict = field(default_factory=lambda: {"a": 40, "b": 17, "c": 70})  # rid -> seq_len at step 0
    steps: tuple = (10, 11, 12)
    layer: int = 3
    rank: int = 0
    seed: int = 0
    rids: bool = True

    def __post_init__(self):
        g = torch.Generator().manual_seed(self.seed)
        top = max(self.prompt.values()) + len(self.steps) + 4
        n = len(self.prompt) * top
        self.slots = {r: torch.randperm(n, generator=g)[:top] + 0 for r in self.prompt}  # shared pool slots
        perm = torch.randperm(n, generator=g)
        for i, r in enumerate(self.prompt):
            self.slots[r] = perm[i * top : (i + 1) * top] + 1  # disjoint, slot 0 unused
        self.pool = torch.randn(n + 1, 1, D, generator=g).to(torch.bfloat16)
        self.g = g

    def write(self, path, step: int, order: Optional[list] = None, extra: Optional[dict] = None,
              change: Optional[tuple] = None) -> str:  # fmt: skip
        """The capture at ``step``; ``extra`` {rid: k} adds k tokens to a request (a skip),
        ``change`` (rid, position) alters one earlier row in this capture only."""
        order = order or list(self.prompt)
        k = step - self.steps[0]
        lens = [self.prompt[r] + k + (extra or {}).get(r, 0) for r in order]
        pool = self.pool.clone()
        if change is not None:
            pool[self.slots[change[0]][change[1]], 0, 0] += 1.0
        idx = torch.cat([self.slots[r][:L] for r, L in zip(order, lens)])
        indptr = torch.tensor([0, *torch.cumsum(torch.tensor(lens), 0).tolist()], dtype=torch.int32)
        q = torch.randn(len(order), 2, D, generator=self.g).to(torch.bfloat16)
        out, _ = mla_control(q, pool, Attended.token_index(indptr, idx), Scales(kv_lora_rank=DV, sm_scale=0.1), torch.bfloat16)
        t = {"q": q, "kv_buffer": pool, "kv_indptr": indptr, "kv_indices": idx.int(),
             "seq_lens": torch.tensor(lens, dtype=torch.int32), "out": out}  # fmt: skip
        meta = {
            "mode": "decode",
            "backend": "triton",
            "kv_lora_rank": DV,
            "qk_rope_head_dim": DR,
            "sm_scale": 0.1,
            "logit_cap": 0.0,
            "page_size": 1,
            "layer_id": self.layer,
            "tp_rank": self.rank,
            "step": step,
        }
        if self.rids:
            meta["rids"] = order
        write_capture(path, t, meta)
        return str(path)


def warnings_of(found: dict) -> list:
    """The warnings among series findings, as their JSON (what a user reads)."""
    return [f.to_json() for fs in found.values() for f in fs if f.severity == "warning"]


def as_json(findings: list) -> list:
    return [f.to_json() for f in findings]


# --------------------------------------------------------------------------------------------


def test_clean_series_paired_by_rid_across_a_reordered_batch(tmp_path):
    s = Series()
    paths = [s.write(tmp_path / "s10.safetensors", 10), s.write(tmp_path / "s11.safetensors", 11),
             s.write(tmp_path / "s12.safetensors", 12, order=["c", "a", "b"])]  # fmt: skip
    found = series_checks(paths[::-1])  # given in any order: sorted by meta step
    assert set(found) == set(paths) and warnings_of(found) == []


def test_seq_len_that_skips_a_step(tmp_path):
    s = Series()
    paths = [s.write(tmp_path / f"s{k}.safetensors", k, extra={"b": 1} if k == 12 else None) for k in s.steps]
    found = series_checks(paths)
    bad = warnings_of(found)
    assert len(bad) == 1
    f = bad[0]
    assert f["check"] == "seq_len_step" and f["rid"] == "b" and (f["delta"], f["expected_delta"]) == (2, 1)
    assert f in as_json(found[paths[2]]) and f["previous"] == paths[1]


def test_earlier_row_changed_between_steps(tmp_path):
    s = Series()
    paths = [s.write(tmp_path / f"s{k}.safetensors", k, change=("c", 33) if k == 11 else None) for k in s.steps]
    found = series_checks(paths)
    bad = warnings_of(found)
    # step 11 differs from step 10 at position 33, and step 12 from step 11 again
    assert [(f["check"], f["rid"], f["first_position"], f["count"]) for f in bad] == [
        ("kv_rows_changed", "c", 33, 1), ("kv_rows_changed", "c", 33, 1)]  # fmt: skip
    assert bad[0] in as_json(found[paths[1]]) and bad[1] in as_json(found[paths[2]])


def test_series_without_rids_pairs_by_order_and_honours_step_gaps(tmp_path):
    s = Series(rids=False, steps=(10, 12, 13))
    paths = [s.write(tmp_path / f"s{k}.safetensors", k) for k in (10, 12)]
    assert warnings_of(series_checks(paths)) == [], "step 10 -> 12 grows by 2"
    s2 = Series(rids=False)
    p2 = [s2.write(tmp_path / f"t{k}.safetensors", k, extra={"a": -1} if k == 11 else None) for k in (10, 11)]
    bad = warnings_of(series_checks(p2))
    assert [(f["request"], f["delta"]) for f in bad] == [(0, 0)]


def test_layers_and_ranks_are_separate_series(tmp_path):
    a, b = Series(layer=1), Series(layer=2, seed=1)
    paths = [a.write(tmp_path / "l1s10.safetensors", 10), b.write(tmp_path / "l2s11.safetensors", 11)]
    assert series_checks(paths) == {paths[0]: [], paths[1]: []}  # nothing to pair across layers


def good_dir(tmp_path):
    s = Series()
    d = tmp_path / "caps"
    d.mkdir()
    paths = [s.write(d / f"l3_r0_s{k}.safetensors", k, extra={"b": 1} if k == 12 else None) for k in s.steps]
    (d / "l3_r0_s99.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")  # broken
    return d, paths


@pytest.mark.parametrize("jobs", [1, 2])
def test_directory_with_one_broken_file(tmp_path, capsys, jobs):
    d, paths = good_dir(tmp_path)
    code = main(["replay", str(d), "--backend", "reference", "--json", "--jobs", str(jobs)])
    assert code == 2
    reports = json.loads(capsys.readouterr().out)
    assert [r["capture"] for r in reports] == sorted(paths + [str(d / "l3_r0_s99.safetensors")])
    verdicts = {r["capture"]: r["verdict"] for r in reports}
    assert verdicts.pop(str(d / "l3_r0_s99.safetensors")) == "invalid"
    assert set(verdicts.values()) == {"agree"}
    series = {r["capture"]: r.get("series") for r in reports}
    assert series[paths[0]] == [] and series[paths[1]] == []
    assert [f["check"] for f in series[paths[2]]] == ["seq_len_step"]


def test_summary_table_by_layer_rank_step(tmp_path, capsys):
    d, _ = good_dir(tmp_path)
    assert main(["replay", str(d), "--backend", "reference"]) == 2
    text = capsys.readouterr().out
    table = text[text.index("summary by layer, rank and step") :]
    rows = [line.split() for line in table.splitlines()[3:6]]
    assert [r[:5] for r in rows] == [["3", "0", "10", "1", "1"], ["3", "0", "11", "1", "1"], ["3", "0", "12", "1", "1"]]
    assert "4 captures: 3 agree, 0 diverged, 1 invalid; 1 series finding(s)" in table
    assert "invalid " + str(d / "l3_r0_s99.safetensors") in table


def test_summary_table_counts_diverged_and_worst_backend():
    def rep(layer, step, verdict, err=None):
        b = {"observed": BackendEntry("fail" if err else "pass", max_abs_err=err or 0.0)}
        return ReplayReport(capture=f"x{layer}{step}", verdict=verdict, diagnosis="observed" if err else None,
                            meta=parse_meta({**META, "layer_id": layer, "tp_rank": 0, "step": step}), metadata=MetadataReport(ok=True),
                            backends=b)  # fmt: skip

    text = summary_table([rep(1, 0, "agree"), rep(0, 1, "diverged", 0.5), rep(0, 1, "diverged", 0.25)])
    lines = text.splitlines()
    assert lines[3].split()[:6] == ["0", "0", "1", "2", "0", "2"] and "observed 0.5" in lines[3]
    assert lines[4].split()[:3] == ["1", "0", "0"]


def test_replay_one_never_raises(tmp_path):
    _, paths = good_dir(tmp_path)
    rep = replay_one(paths[0], None)  # an internal error (no options) becomes an invalid report
    assert rep.verdict == "invalid" and "AttributeError" in rep.error


def test_inspect_directory_runs_series_checks(tmp_path, capsys):
    d, paths = good_dir(tmp_path)
    (d / "l3_r0_s99.safetensors").unlink()
    assert main(["inspect", str(d), "--json"]) == 1
    entries = json.loads(capsys.readouterr().out)
    assert [len(e["series"]) for e in entries] == [0, 0, 1]
    assert main(["inspect", *paths[:2]]) == 0


def test_replay_plots(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from refmla.synthetic import SynthSpec, synth_capture

    spec = SynthSpec(name="plot", num_heads=4, seq_lens=(100, 300, 200), page_size=16, kv_lora_rank=32,
                     qk_rope_head_dim=8, fault_request=1)  # fmt: skip
    synth_capture(tmp_path / "bad.safetensors", spec, "kv_range_missing")
    out = tmp_path / "plots"
    assert main(["replay", str(tmp_path / "bad.safetensors"), "--backend", "reference", "--plot", str(out)]) == 1
    files = sorted(p.name for p in out.iterdir())
    assert files == ["bad.attention.png", "bad.heatmap.png"]
    for f in out.iterdir():
        assert f.read_bytes()[:4] == b"\x89PNG"


def test_plot_without_matplotlib_is_one_line_exit_2(tmp_path, capsys, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    monkeypatch.delitem(sys.modules, "refmla.plots", raising=False)
    for mod in [m for m in sys.modules if m.startswith("matplotlib.")]:
        monkeypatch.setitem(sys.modules, mod, None)
    _, paths = good_dir(tmp_path)
    assert main(["replay", paths[0], "--plot", str(tmp_path / "p")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "matplotlib" in err[0] and "refmla[plot]" in err[0]
    assert main(["diff-kv", paths[0], paths[1], "--plot", str(tmp_path / "p")]) == 2
    assert "matplotlib" in capsys.readouterr().err


def replay_one_that_dies_on_step_11(path, opts):
    """Stands in for a capture that kills its worker process (a segfault in a kernel, say)."""
    import os

    if path.endswith("s11.safetensors"):
        os._exit(7)
    return replay_one(path, opts)


def test_a_worker_that_dies_costs_only_its_own_capture(tmp_path, monkeypatch):
    import refmla.batch as batch
    from refmla.context import ReplayOptions

    _, paths = good_dir(tmp_path)
    monkeypatch.setattr(batch, "replay_one", replay_one_that_dies_on_step_11)
    reports = batch.replay_many(paths, ReplayOptions(backends=["reference"]), jobs=2)
    assert [r.verdict for r in reports] == ["agree", "invalid", "agree"]
    assert "worker process died" in reports[1].error
