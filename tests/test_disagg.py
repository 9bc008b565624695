"""`refmla disagg` on synthetic disaggregated pairs (refmla.synthetic.disagg): every planted fault is named
with its request, layer, rank, position / page / run / step and class; a clean pair is clean."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest

from refmla.cli import main
from refmla.context import ReplayOptions
from refmla.disagg import run_disagg
from refmla.synthetic.disagg import disagg_preset, synth_disagg
from refmla.synthetic.disagg_faults import DISAGG_FAULTS

FAST = ReplayOptions(backends=["extend"])  # reference, observed and the extend baseline (no interpreted Triton)


def files(root: Path, side: str) -> list[str]:
    return sorted(str(p) for p in (root / side).glob("*.safetensors"))


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """fault -> (folder, what was planted), written once for the module."""
    root = tmp_path_factory.mktemp("disagg")
    return {f: (root / f, synth_disagg(root / f, disagg_preset("disagg-small"), f)) for f in DISAGG_FAULTS}


def run(root: Path, opts: ReplayOptions = FAST):
    return run_disagg(files(root, "prefill"), files(root, "decode"), opts)


def check_named(report, expect: dict) -> None:
    """The rows the fault hits carry its class and numbers; every other row is clean."""
    hit = [r for r in report.rows if expect["all_rows"] or (r.rid, r.layer, r.rank) == (expect["rid"], expect["layer"], expect["rank"])]
    assert hit, "the fault's row is missing"
    for r in report.rows:
        want = expect["class"] if r in hit else "none"
        assert r.fault == want, f"{r.where()}: {r.fault} != {want}: {r.sentence}"
    row = next(r for r in hit if (r.rid, r.layer, r.rank) == (expect["rid"], expect["layer"], expect["rank"]))
    t = row.transfer
    if expect["class"] == "transfer":
        assert t.status == "mismatch" and t.first_mismatch == expect["position"] and t.first_page == expect["page"]
        assert t.run is not None and t.run["start"] <= expect["position"] < t.run["end"]
        assert t.run.get("offset") == expect.get("offset")
        assert f"first position {expect['position']} (page {expect['page']})" in row.sentence
        assert t.source_rid == expect.get("source_rid")
        if expect.get("source_rid"):
            assert f"holds the KV of request {expect['source_rid']}" in row.sentence
        if expect.get("zero_rows"):
            assert t.decode_zero_rows == t.mismatched_positions and "not landed" in row.sentence
    else:
        assert t.status == "faithful", row.sentence
    if "step" in expect and expect["class"] == "compute":
        assert row.decode.step == expect["step"] and row.decode.diagnosis == expect["diagnosis"]
        assert row.decode.backends["observed"] == "fail" and row.decode.backends["extend"] == "pass"
        assert "kv_range_missing" in (row.decode.explanation or "")
    if expect.get("check"):
        assert expect["check"] in row.metadata.checks()
        (path, finding), *_ = row.metadata.problems
        assert finding.numbers["step"] == expect["step"] and path.endswith(f"s{expect['step']}.safetensors")
    if expect.get("region") == "finding":
        assert row.metadata.region.is_finding and "MR limit" in row.sentence
        assert all(c.is_finding for _, _, c in report.regions)
    assert report.fault == expect["class"] and row.where() in report.sentence or expect["all_rows"]


@pytest.mark.parametrize("fault", [f for f in DISAGG_FAULTS if f != "none"])
def test_each_planted_fault_is_named(pairs, fault):
    root, planted = pairs[fault]
    report = run(root)
    check_named(report, planted["expect"])
    assert report.exit_code == 1 and not report.invalid


def test_a_clean_pair_is_clean(pairs):
    root, _ = pairs["none"]
    report = run(root)
    assert report.exit_code == 0 and report.fault == "none" and report.sentence.startswith("no fault")
    assert len(report.rows) == 4 * 2 and all(r.transfer.status == "faithful" for r in report.rows)
    assert all(r.decode.verdict == "agree" and r.decode.steps == 2 for r in report.rows)
    assert all(c.status == "ok" for _, _, c in report.regions)
    assert {len(r.prefill_captures) for r in report.rows} <= {1, 2}  # chunked prefill: the chunks that hold it
    assert any(len(r.prefill_captures) == 2 for r in report.rows)


def test_cli_every_backend_json_and_text(pairs, capsys, tmp_path):
    root, planted = pairs["kernel_dropped"]
    code = main(["disagg", str(root / "prefill"), str(root / "decode"), "--json", "--jobs", "2"])
    doc = json.loads(capsys.readouterr().out)
    assert code == 1 and doc["fault"] == "compute" and not doc["ok"]
    row = next(r for r in doc["rows"] if r["fault"] != "none")
    assert (row["rid"], row["layer"], row["rank"]) == (planted["expect"]["rid"], 1, 0)
    assert row["decode"]["backends"]["triton"] == "pass" and row["decode"]["backends"]["observed"] == "fail"
    assert row["decode"]["diagnosis"] == "observed" and row["transfer"]["status"] == "faithful"
    assert len(doc["replays"]) == 4 and len(doc["diffs"]) == 2 and doc["classes"]["compute"] == 1
    assert {"plan", "replay_and_diff_kv", "series", "total"} <= set(doc["seconds"])
    root, _ = pairs["run_shifted"]
    plots = tmp_path / "plots"
    assert main(["disagg", str(root / "prefill"), str(root / "decode"), "--backend", "extend", "--plot", str(plots)]) == 1
    out = capsys.readouterr().out
    assert "shift +1" in out and "verdict  fault in the transfer" in out
    assert list(plots.rglob("diffkv.*.png"))  # the mismatching diff-kv, drawn


def test_an_unpaired_request_is_not_called_faithful(pairs, tmp_path):
    root, _ = pairs["none"]
    shutil.copytree(root, tmp_path / "pair")
    for p in (tmp_path / "pair" / "prefill").glob("L1-*"):
        p.unlink()  # layer 1's prefill captures lost
    report = run(tmp_path / "pair")
    layer1 = [r for r in report.rows if r.layer == 1]
    assert layer1 and all(r.transfer.status == "not_paired" and "not checked" in r.sentence for r in layer1)
    assert "was not checked" in report.sentence and report.exit_code == 0


def test_prefill_of_another_rank_pairs_when_the_rank_has_none(tmp_path):
    spec = dataclasses.replace(disagg_preset("disagg-small"), ranks=(0, 1), layers=(1,), fault_rank=1)
    planted = synth_disagg(tmp_path, spec, "page_missing")
    for p in (tmp_path / "prefill").glob("*-R1-*"):
        p.unlink()  # MLA's latent KV is the same on every rank: rank 0's prefill stands in
    report = run(tmp_path)
    check_named(report, planted["expect"])
    assert all("R0" in Path(p).name for r in report.rows for p in r.prefill_captures)


def test_an_invalid_capture_is_exit_2_and_the_rest_still_runs(pairs, tmp_path, capsys):
    root, _ = pairs["none"]
    shutil.copytree(root, tmp_path / "pair")
    (tmp_path / "pair" / "decode" / "L0-R0-s1.safetensors").write_bytes(b"not a capture")
    code = main(["disagg", str(tmp_path / "pair" / "prefill"), str(tmp_path / "pair" / "decode"), "--backend", "extend"])
    out, err = capsys.readouterr()
    errors = [line for line in err.splitlines() if line.startswith("refmla: error")]  # the rest: progress
    assert code == 2 and len(errors) == 1 and "L0-R0-s1.safetensors" in errors[0]
    assert "faithful" in out and "Traceback" not in err


def test_usage_errors(capsys, tmp_path):
    assert main(["disagg", "a", "b", "c"]) == 2
    assert "--decode" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["disagg", str(tmp_path / "empty"), str(tmp_path / "empty")]) == 2


# ---------------------------------------------------------------------------------------------
# Precedence of the classes, on hand-made rows (no capture needed)
# ---------------------------------------------------------------------------------------------


def _row(transfer="faithful", problems=(), decode="agree", region=None):
    from refmla.disagg import DecodeCell, MetadataCell, Row, TransferCell
    from refmla.results import Finding

    t = TransferCell(transfer, 10, 3 if transfer == "mismatch" else 0, 4 if transfer == "mismatch" else None, 0)
    md = MetadataCell(problems=[("c.safetensors", Finding(c, "warning", f"{c} message")) for c in problems],
                      region=region, region_capture="c.safetensors" if region else None)
    d = DecodeCell(decode, diagnosis="decode" if decode == "diverged" else None, diagnosis_text="text", step=3)
    return Row("r0", 0, 1, t, md, d)


@pytest.mark.parametrize("kw,want", [
    ({}, "none"),
    ({"decode": "diverged"}, "compute"),
    ({"decode": "invalid"}, "metadata"),
    ({"problems": ["zero_rows"], "decode": "diverged"}, "metadata"),
    ({"transfer": "mismatch", "problems": ["zero_rows"], "decode": "diverged"}, "transfer"),
    ({"transfer": "mismatch", "problems": ["req_to_token"]}, "metadata"),
    ({"transfer": "not_paired"}, "none"),
])  # fmt: skip
def test_the_cause_comes_before_its_symptoms(kw, want):
    from refmla.disagg import classify

    fault, sentence = classify(_row(**kw))
    assert fault == want and sentence.startswith("request r0 layer 0 rank 1")
    if kw.get("transfer") == "not_paired":
        assert "not checked" in sentence


def test_a_region_finding_alone_is_a_transfer_fault():
    from refmla.capture import parse_meta
    from refmla.disagg import classify, overall
    from refmla.region_check import check_region

    meta = parse_meta({"mode": "decode", "backend": "triton", "kv_lora_rank": 512, "qk_rope_head_dim": 64,
                       "sm_scale": 0.1, "logit_cap": 0.0, "page_size": 1, "kv_pool_rows": 4_000_000,
                       "kv_pool_row_bytes": 1152})  # fmt: skip
    row = _row(region=check_region(meta))
    row.fault, row.sentence = classify(row)
    assert row.fault == "transfer" and "MR limit" in row.sentence and "4608000000" in row.sentence
    assert overall([row], [])[0] == "transfer"
    clean = _row()
    clean.fault, clean.sentence = classify(clean)
    assert overall([clean], ["region over"]) == ("transfer", "fault in the transfer: region over")
