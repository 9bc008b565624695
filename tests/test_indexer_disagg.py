"""`refmla disagg` over folders that hold indexer captures (mode indexer) beside the sparse decode
captures: never an invalid KV capture, never a silent pass. The decode and its indexer call are
built as tests/test_indexer_chain.py builds them (SGLang's own indexer code, refmla's sparse synth
for the decode); the stale indices are planted by the test's own code."""

from __future__ import annotations

import json
import shutil

import indexer_kit as kit
from hostile import run_cli
from test_indexer_chain import K, SEQ, opts, pair

from refmla.disagg import run_disagg


def sides(tmp_path, fault="none"):
    pre, dec = tmp_path / "prefill", tmp_path / "decode"
    pre.mkdir()
    dec.mkdir()
    pair(dec, fault)
    return pre, dec


def paths(folder):
    return sorted(str(p) for p in folder.glob("*.safetensors"))


def test_stale_indices_beside_the_decode_are_each_requests_upstream_indexer_fault(tmp_path):
    pre, dec = sides(tmp_path, "topk_stale")
    r = run_disagg([], paths(dec), opts())
    assert not r.invalid, r.invalid  # the indexer capture is not read as a KV capture
    assert r.exit_code == 1 and r.fault == "compute"
    assert [row.decode.diagnosis for row in r.rows] == ["upstream_indexer"] * len(SEQ)
    assert "indexer chose the wrong entries" in r.rows[1].sentence
    assert any("judged with the sparse decode capture beside" in n for n in r.notes)


def test_a_clean_pair_is_no_fault_and_says_the_indexer_was_judged(tmp_path):
    pre, dec = sides(tmp_path)
    r = run_disagg([], paths(dec), opts())
    assert not r.invalid and r.exit_code == 0 and r.fault == "none", r.sentence
    assert [row.decode.verdict for row in r.rows] == ["agree"] * len(SEQ)
    assert any("1 indexer capture(s) judged with" in n for n in r.notes)


def test_an_indexer_capture_with_no_decode_beside_it_is_judged_alone_and_its_wrong_set_is_a_fault(tmp_path):
    pre, dec = sides(tmp_path)
    t, m = kit.call(SEQ, topk=K, seed=5, fault="topk_stale")
    m["step"] = 99  # another step: no decode capture of it
    kit.raw_write(pre / "indexer-prefill.safetensors", t, m)
    r = run_disagg(paths(pre), paths(dec), opts())
    assert not r.invalid and len(r.indexers) == 1 and r.indexers[0].verdict == "diverged"
    assert r.exit_code == 1 and r.fault == "compute" and "judged alone" in r.sentence
    assert any("indexer-prefill.safetensors: judged alone" in n for n in r.notes)


def test_the_command_line_json_carries_the_indexer_reports_and_exits_1(tmp_path):
    pre, dec = sides(tmp_path, "topk_stale")
    shutil.copy(dec / "indexer.safetensors", pre / "alone.safetensors")  # its decode is on the other side
    code, out, err = run_cli("disagg", str(pre), str(dec), "--backend", "reference", "--json")
    assert code == 1, err
    doc = json.loads(out)
    assert doc["invalid"] == [] and doc["rows"][0]["decode"]["diagnosis"] == "upstream_indexer"
    assert [x["kind"] for x in doc["indexers"]] == ["indexer"] and doc["indexers"][0]["verdict"] == "diverged"
