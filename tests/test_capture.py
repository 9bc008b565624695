"""Capture files: round trip, compaction, atomic writes, and every bad input -> exit 2, one line."""

import json
import os

import pytest
import torch

from helpers import raw_write
from refmla.capture import CaptureError, read_capture, write_capture
from refmla.cli import main
from refmla.context import ReplayOptions
from refmla.pipeline import replay_capture
from refmla.synthetic import make_inputs, make_meta, preset


@pytest.fixture
def clean(tmp_path):
    spec = preset("hostile")
    t, meta = make_inputs(spec), make_meta(spec)
    t["out"] = torch.zeros(t["q"].shape[0], spec.num_heads, 512, dtype=spec.dtype)
    return t, meta


def test_round_trip_with_compaction_preserves_the_replay_bit_for_bit(tmp_path, clean):
    t, meta = clean
    write_capture(tmp_path / "full.safetensors", t, meta, compact=False)
    write_capture(tmp_path / "compact.safetensors", t, meta, compact=True)
    full, small = read_capture(tmp_path / "full.safetensors"), read_capture(tmp_path / "compact.safetensors")
    assert small.kv_buffer.shape[0] == int(t["seq_lens"].sum()) < full.kv_buffer.shape[0]
    assert not torch.isnan(small.kv_buffer.float()).any(), "compaction keeps only attended rows"
    assert torch.equal(small.orig_kv_indices, t["kv_indices"].long())
    assert torch.equal(small.kv_buffer[small.kv_indices.long()], full.kv_buffer[full.kv_indices.long()])
    opts = ReplayOptions(backends=[])
    a, b = replay_capture(full, opts).to_json(), replay_capture(small, opts).to_json()
    assert a["backends"]["observed"]["max_abs_err"] == b["backends"]["observed"]["max_abs_err"]
    assert a["backends"]["observed"]["worst"] == b["backends"]["observed"]["worst"]


def test_compaction_keeps_req_to_token_rows_and_marks_the_rest(tmp_path, clean):
    t, meta = clean
    B, M = t["seq_lens"].shape[0], int(t["seq_lens"].max()) + 5
    r2t = torch.full((B, M), 0, dtype=torch.int32)  # stale zeros past each seq_len
    for b in range(B):
        L = int(t["seq_lens"][b])
        r2t[b, :L] = t["kv_indices"][int(t["kv_indptr"][b]) : int(t["kv_indptr"][b]) + L]
    t["req_to_token"] = r2t
    write_capture(tmp_path / "c.safetensors", t, meta)
    cap = read_capture(tmp_path / "c.safetensors")
    for b in range(B):
        L = int(cap.seq_lens[b])
        assert torch.equal(cap.req_to_token[b, :L].long(), cap.kv_indices[int(cap.kv_indptr[b]) : int(cap.kv_indptr[b]) + L].long())
        assert bool((cap.req_to_token[b, L:] == -1).all())


def test_write_is_atomic_and_validates_first(tmp_path, clean):
    t, meta = clean
    target = tmp_path / "cap.safetensors"
    write_capture(target, t, meta)
    before = target.read_bytes()
    bad = dict(t, kv_indices=t["kv_indices"] + 10_000)  # out of range
    with pytest.raises(CaptureError, match="kv_indices"):
        write_capture(target, bad, meta, compact=False)
    assert target.read_bytes() == before, "a failed write must not touch the existing file"
    assert sorted(os.listdir(tmp_path)) == ["cap.safetensors"], "no temp files left behind"


# --- bad input: exit 2, one line naming the file and the tensor or key ------------------------


def _mutations(t, meta):
    """(name, tensors, meta, fmt, expected words in the message)"""
    m = dict(meta)
    yield "wrong format", t, m, "something/9", "format"
    yield "missing meta key", t, {k: v for k, v in m.items() if k != "sm_scale"}, None, "sm_scale"
    yield "meta not json", t, "{not json", None, "meta"
    yield "bad mode", t, dict(m, mode="prefill"), None, "mode"
    yield "missing tensor", {k: v for k, v in t.items() if k != "kv_indices"}, m, None, "kv_indices"
    yield "wrong rank", dict(t, kv_buffer=t["kv_buffer"][:, 0]), m, None, "kv_buffer"
    yield "wrong head dim", dict(t, q=t["q"][..., :500]), m, None, "'q'"
    yield "wrong dtype", dict(t, kv_indptr=t["kv_indptr"].float()), m, None, "kv_indptr"
    ip = t["kv_indptr"].clone()
    ip[1] = ip[2] + 5  # request 0 ends after request 1 ends
    yield "indptr not monotone", dict(t, kv_indptr=ip), m, None, "monotone"
    yield "indptr end != len(indices)", dict(t, kv_indices=t["kv_indices"][:-1]), m, None, "kv_indices"
    sl = t["seq_lens"].clone()
    sl[0] += 1
    yield "seq_lens disagree", dict(t, seq_lens=sl), m, None, "seq_lens"
    idx = t["kv_indices"].clone()
    idx[3] = t["kv_buffer"].shape[0]
    yield "index out of range", dict(t, kv_indices=idx), m, None, "out of range"
    sl = t["seq_lens"].clone()
    sl[1] = -1
    yield "negative length", dict(t, seq_lens=sl), m, None, "negative"
    yield "out shape", dict(t, out=t["out"][:, :2]), m, None, "'out'"


@pytest.mark.parametrize("case", range(14))
def test_bad_input_exits_2_with_one_line(tmp_path, clean, capsys, case):
    name, t, meta, fmt, words = list(_mutations(*clean))[case]
    path = tmp_path / "bad.safetensors"
    raw_write(path, t, meta, fmt=fmt or "refmla.capture/1")
    for argv in (["replay", str(path)], ["inspect", str(path)]):
        code = main(argv)
        err = capsys.readouterr().err.strip()
        assert code == 2, name
        assert len(err.splitlines()) == 1 and "Traceback" not in err, err
        assert str(path) in err and words in err, f"{name}: {err}"


@pytest.mark.parametrize("content", [b"", b"not a safetensors file at all", "truncated"])
def test_unreadable_files_exit_2(tmp_path, clean, capsys, content):
    path = tmp_path / "x.safetensors"
    if content == "truncated":
        write_capture(path, *clean)
        path.write_bytes(path.read_bytes()[:-100])
    else:
        path.write_bytes(content)
    assert main(["replay", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(path) in err and "file" in err


def test_missing_file_exits_2(tmp_path, capsys):
    assert main(["inspect", str(tmp_path / "nope.safetensors")]) == 2
    assert "no such file" in capsys.readouterr().err


def test_nan_in_q_is_a_warning_and_still_replayed(tmp_path, clean, capsys):
    t, meta = clean
    q = t["q"].clone()
    q[1, 0, 5] = float("nan")
    path = tmp_path / "nanq.safetensors"
    write_capture(path, dict(t, q=q), meta, compact=False)
    code = main(["replay", str(path), "--backend", "reference", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert report["verdict"] in ("agree", "diverged") and code in (0, 1)
    assert any("NaN" in w for w in report["metadata"]["warnings"])


def test_unknown_tensors_are_named_in_a_warning_not_an_error(tmp_path, clean, capsys):
    t, meta = clean
    path = tmp_path / "extra.safetensors"
    raw_write(path, dict(t, positions=torch.arange(3)), meta)
    cap = read_capture(path)
    assert any("positions" in w for w in cap.warnings)
    assert main(["replay", str(path), "--backend", "reference", "--json"]) in (0, 1)
    assert "positions" in json.loads(capsys.readouterr().out)["metadata"]["warnings"][-1]
