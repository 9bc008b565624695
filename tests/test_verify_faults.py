"""Planted verify faults (issue 13): each is named by its hypothesis with its detail; clean verify
captures agree. Replayed with the reference only (the observed output is the planted one)."""

from __future__ import annotations

import pytest

from refmla.capture import read_capture
from refmla.cli import main
from refmla.context import ReplayOptions
from refmla.pipeline import replay_capture
from refmla.synthetic import EXPECT, FAULT_MODES, VERIFY_PRESET, preset, synth_capture

VERIFY_FAULTS = [f for f, m in FAULT_MODES.items() if m == "verify"]
SMALL = {"kimi-k2-tp8-mtp": dict(seq_lens=(300, 41, 130, 35)), "kimi-k2-tp8-eagle-tree": dict(seq_lens=(120, 133, 70))}


def _replay(tmp_path, name, fault):
    path = tmp_path / f"{name}-{fault}.safetensors"
    planted = synth_capture(path, preset(name, **SMALL.get(name, {})), fault)
    rep = replay_capture(read_capture(path), ReplayOptions(backends=["reference"])).to_json()
    return planted, rep


def test_every_verify_fault_is_registered_with_its_preset():
    assert sorted(VERIFY_FAULTS) == ["causal_top_left", "draft_kv_missing", "mask_wrong_request", "qlen_pow2_padding"]
    assert all(VERIFY_PRESET[f] in ("kimi-k2-tp8-mtp", "kimi-k2-tp8-eagle-tree") for f in VERIFY_FAULTS)


@pytest.mark.parametrize("fault", VERIFY_FAULTS)
def test_verify_fault_is_named_with_its_detail(tmp_path, fault):
    planted, rep = _replay(tmp_path, VERIFY_PRESET[fault], fault)
    obs = rep["backends"]["observed"]
    assert rep["verdict"] == "diverged" and obs["status"] == "fail"
    exp = obs.get("explanation")
    assert exp is not None, f"{fault}: not explained ({obs.get('reason')})"
    assert exp["hypothesis"] == EXPECT[fault]
    for key, value in exp["detail"].items():  # the detail says what was planted
        if key in planted and fault != "mask_wrong_request":  # that one: per request, below
            assert planted[key] == value or planted[key] in str(value).split(" or "), (key, planted, exp["detail"])
    if fault == "mask_wrong_request":
        found = {r["request"]: r["detail"]["mask_of"] for r in exp.get("requests", [])} or {exp["request"]: exp["detail"]["mask_of"]}
        B = 3
        assert all(m == (b + 1) % B for b, m in found.items())


@pytest.mark.parametrize("name", ["kimi-k2-tp8-mtp", "kimi-k2-tp8-mtp1", "kimi-k2-tp8-mtp3", "kimi-k2-tp8-eagle-tree"])
def test_clean_verify_captures_agree(tmp_path, name):
    _, rep = _replay(tmp_path, name, "none")
    assert rep["verdict"] == "agree" and rep["mode"] == "verify"
    assert rep["backends"]["observed"]["status"] == "pass"


def test_a_verify_fault_on_a_decode_preset_is_a_usage_error(tmp_path, capsys):
    assert main(["synth", str(tmp_path / "x.safetensors"), "--fault", "causal_top_left"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "verify preset" in err[0]


def test_pow2_needs_a_non_power_of_two_qlen(tmp_path, capsys):
    assert main(["synth", str(tmp_path / "x.safetensors"), "--preset", "kimi-k2-tp8-mtp3", "--fault",
                 "qlen_pow2_padding"]) == 2  # fmt: skip
    assert "power of two" in capsys.readouterr().err


# --- diagnosis: which of verify and plain decode diverges over the same KV --------------------

from refmla.diagnosis import diagnose_verify  # noqa: E402

BASE = {"reference": "pass", "observed": "pass", "triton": "skipped", "aiter": "skipped", "extend": "pass",
        "triton_decode_per_query": "pass", "aiter_decode_per_query": "skipped"}  # fmt: skip


@pytest.mark.parametrize("changes,name,about", [
    ({}, None, []),
    ({"extend": "fail"}, "verify", ["extend"]),
    ({"aiter": "fail", "aiter_decode_per_query": "pass"}, "verify", ["aiter"]),
    ({"triton_decode_per_query": "fail"}, "decode", ["triton_decode_per_query"]),
    ({"extend": "fail", "triton_decode_per_query": "fail"}, "shared_input", ["extend", "triton_decode_per_query"]),
    ({"observed": "fail"}, "observed", ["observed"]),
    ({"observed": "fail", "extend": "skipped"}, "verify", ["observed"]),
])  # fmt: skip
def test_diagnose_verify(changes, name, about):
    d = diagnose_verify({**BASE, **changes}, produced_by="aiter")
    got, sentence, backends = d.name, d.text, d.backends
    assert got == name and backends == about and sentence
    if name == "decode":
        assert "verify path agrees (extend)" in sentence
    if changes == {"observed": "fail", "extend": "skipped"}:
        assert "state at kernel time" in sentence


def test_verify_report_carries_the_paths_table(tmp_path):
    _, rep = _replay(tmp_path, "kimi-k2-tp8-mtp", "draft_kv_missing")
    rows = {r["backend"]: r for r in rep["verify_vs_decode"]}
    assert rows["observed"]["status"] == "fail" and rows["observed"]["path"] == "verify (production)"
    decode_rep = replay_capture(read_capture(synth_decode(tmp_path)), ReplayOptions(backends=["reference"])).to_json()
    assert "verify_vs_decode" not in decode_rep


def synth_decode(tmp_path):
    path = tmp_path / "d.safetensors"
    synth_capture(path, preset("kimi-k2-tp8", seq_lens=(20, 9), num_kv_splits=None))
    return path
