"""Metadata forensics: every fact found completely (count and first position per request)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from refmla.capture import read_capture, write_capture
from refmla.checks import check_capture
from refmla.pool import per_request
from refmla.cli import main
from refmla.synthetic import SynthSpec, make_inputs, make_meta

SPEC = SynthSpec(name="checks", num_heads=2, seq_lens=(40, 17, 64, 0), page_size=16, kv_lora_rank=32,
                 qk_rope_head_dim=8, free_pages=2, seed=4)  # fmt: skip


def inputs() -> dict:
    """Synthetic inputs: shuffled pages, NaN in every unattended row, page 0 left unused (SGLang
    keeps slot 0 for padded tokens)."""
    t = make_inputs(SPEC)
    P = SPEC.page_size
    t["kv_buffer"] = torch.cat([torch.full_like(t["kv_buffer"][:P], math.nan), t["kv_buffer"]])
    t["kv_indices"] = t["kv_indices"] + P
    return t


def inputs_with_req_to_token() -> dict:
    """inputs() plus SGLang's req_to_token rows: the request's slots, then stale entries past seq_len."""
    t = inputs()
    B, M = len(SPEC.seq_lens), max(SPEC.seq_lens) + 8
    r2t = torch.zeros(B, M, dtype=torch.int32)  # SGLang leaves stale slots / zeros past seq_len
    for b in range(B):
        a, e = int(t["kv_indptr"][b]), int(t["kv_indptr"][b + 1])
        r2t[b, : e - a] = t["kv_indices"][a:e]
    t["req_to_token"] = r2t
    return t


def slot(t: dict, b: int, j: int) -> int:
    return int(t["kv_indices"][int(t["kv_indptr"][b]) + j])


def write(tmp_path, t, name="cap.safetensors"):
    path = tmp_path / name
    write_capture(path, t, make_meta(SPEC))
    return read_capture(path)


def by_check(md) -> dict:
    """check name -> its findings, as their JSON (what a user reads)."""
    out: dict = {}
    for f in md.findings:
        out.setdefault(f.check, []).append(f.to_json())
    return out


# --------------------------------------------------------------------------------------------


def test_clean_capture_has_no_findings(tmp_path):
    md = check_capture(write(tmp_path, inputs_with_req_to_token())).to_json()
    assert md == {"ok": True, "errors": [], "warnings": [], "findings": []}, "NaN rows nobody attends are no finding"


def test_req_to_token_disagreeing_names_request_position_and_both_values(tmp_path):
    t = inputs_with_req_to_token()
    t["req_to_token"][1, 5] = slot(t, 0, 3)  # request 1 position 5 points at request 0's row
    t["req_to_token"][1, 9] = slot(t, 0, 4)
    cap = write(tmp_path, t)
    found = by_check(check_capture(cap))["req_to_token"]
    assert len(found) == 1
    f = found[0]
    assert (f["request"], f["count"], f["first_position"]) == (1, 2, 5)
    # both values in the capture's (compacted) numbering, as stored
    assert f["kv_indices"] == int(cap.kv_indices[int(cap.kv_indptr[1]) + 5])
    assert f["req_to_token"] == int(cap.req_to_token[1, 5]) == int(cap.kv_indices[3])
    assert f["same_bytes"] is False and f["rid"] == "checks-1"


def test_req_to_token_pointing_outside_the_pool(tmp_path):
    t = inputs_with_req_to_token()
    t["req_to_token"][2, 0] = t["kv_buffer"].shape[0] + 100  # compacted to -1
    f = by_check(check_capture(write(tmp_path, t)))["req_to_token"][0]
    assert (f["request"], f["first_position"], f["req_to_token"]) == (2, 0, -1)
    assert "outside the pool" in f["message"]


def test_zero_and_nonfinite_rows_at_attended_slots(tmp_path):
    t = inputs_with_req_to_token()
    for j in (7, 20, 21):
        t["kv_buffer"][slot(t, 2, j)] = 0  # a transfer that had not landed
    t["kv_buffer"][slot(t, 0, 3), 0, 11] = math.inf
    t["kv_buffer"][slot(t, 1, 16), 0, 32:] = 0  # only the rope part
    found = by_check(check_capture(write(tmp_path, t)))
    zero = found["zero_rows"]
    assert [(f["request"], f["count"], f["first_position"]) for f in zero] == [(2, 3, 7)]
    bad = found["nonfinite_rows"]
    assert [(f["request"], f["count"], f["first_position"]) for f in bad] == [(0, 1, 3)]
    rope = found["rope_zero_rows"]
    assert [(f["request"], f["count"], f["first_position"]) for f in rope] == [(1, 1, 16)]
    assert "latent_zero_rows" not in found


def test_repeated_slot(tmp_path):
    t = inputs()
    a = int(t["kv_indptr"][2])
    t["kv_indices"][a + 30] = t["kv_indices"][a + 12]
    f = by_check(check_capture(write(tmp_path, t)))["repeated_slots"][0]
    assert (f["request"], f["first_position"], f["earlier_position"]) == (2, 30, 12)


def test_padding_slot_is_a_note_only(tmp_path):
    t = inputs()
    t["kv_buffer"][0] = t["kv_buffer"][slot(t, 0, 0)]  # a real row, so only the slot is odd
    t["kv_indices"][int(t["kv_indptr"][1]) + 2] = 0  # physical slot 0 (kept as orig_kv_indices)
    md = check_capture(write(tmp_path, t)).to_json()
    notes = [f for f in md["findings"] if f["check"] == "padding_slot"]
    assert [(f["request"], f["first_position"]) for f in notes] == [(1, 2)]
    assert md["ok"] and md["warnings"] == []


def test_per_request_counts_and_first_positions():
    flags = torch.tensor([0, 1, 1, 0, 0, 0, 1, 0, 1], dtype=torch.bool)
    indptr = torch.tensor([0, 3, 3, 6, 9])  # lengths 3, 0, 3, 3
    count, first = per_request(flags, indptr)
    assert count.tolist() == [2, 0, 0, 2] and first.tolist() == [1, -1, -1, 0]


def test_inspect_exit_codes(tmp_path, capsys):
    clean = tmp_path / "clean"
    clean.mkdir()
    write(clean, inputs_with_req_to_token())
    assert main(["inspect", str(clean / "cap.safetensors")]) == 0
    t = inputs_with_req_to_token()
    t["kv_buffer"][slot(t, 0, 0)] = 0
    write(tmp_path, t, "zero.safetensors")
    capsys.readouterr()
    assert main(["inspect", str(tmp_path / "zero.safetensors"), "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["metadata"]["findings"][0]["check"] == "zero_rows"
    (tmp_path / "junk.safetensors").write_bytes(b"junk")
    assert main(["inspect", str(tmp_path / "junk.safetensors")]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_replay_reports_findings_without_changing_the_verdict(tmp_path):
    from refmla.context import ReplayOptions
    from refmla.pipeline import replay_file

    t = inputs_with_req_to_token()
    t["req_to_token"][3, 0] = 1  # request 3 has seq_len 0: entries past seq_len are not compared
    t["req_to_token"][2, 40] = slot(t, 0, 1)
    from refmla.synthetic import faulty_output

    t["out"] = faulty_output(SPEC, t, "none")[0]
    write(tmp_path, t)
    rep = replay_file(tmp_path / "cap.safetensors", ReplayOptions(backends=["reference"])).to_json()
    assert rep["verdict"] == "agree"
    assert [f["request"] for f in rep["metadata"]["findings"]] == [2]


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float16])
def test_row_checks_in_other_pool_dtypes(tmp_path, dtype):
    t = inputs()
    t["kv_buffer"] = torch.nan_to_num(t["kv_buffer"]).clamp(-8, 8).to(dtype)
    t["kv_buffer"][slot(t, 1, 4)] = 0
    f = by_check(check_capture(write(tmp_path, t)))["zero_rows"][0]
    assert (f["request"], f["first_position"]) == (1, 4)
