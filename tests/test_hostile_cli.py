"""Issue 12, the command line under hostile input: one bad capture never hides the others (serial
and parallel alike), usage errors are one line, nothing past validation is a bare exception, and
diff-kv never calls "nothing compared" a match."""

import json
import os

import pytest
import torch

from hostile import SMALL, error_lines, run_cli, small_capture, write_small
from refmla.synthetic import preset


def _no_heads(t, m):
    t["q"], t["out"] = t["q"][:, :0], t["out"][:, :0]


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """good, zero heads, unparseable meta, a 250-character name, a FIFO, in one folder."""
    d = tmp_path_factory.mktemp("mixed")
    write_small(d / "a-good.safetensors")
    write_small(d / "b-heads0.safetensors", _no_heads)
    data = (d / "a-good.safetensors").read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    header["__metadata__"]["meta"] = "{not json"
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    (d / "c-badmeta.safetensors").write_bytes(len(text).to_bytes(8, "little") + text + data[8 + n :])
    write_small(d / ("d" * 240 + ".safetensors"))
    os.mkfifo(d / "e-fifo.safetensors")
    return d


EXPECTED = {"a-good": "agree", "b-heads0": "invalid", "c-badmeta": "invalid", "d" * 240: "agree", "e-fifo": "invalid"}


@pytest.mark.parametrize("jobs", ["1", "2"])
def test_every_capture_is_reported_serial_and_parallel_alike(mixed, jobs):
    code, out, err = run_cli("replay", str(mixed), "--backend", "reference", "--no-explain", "--json", "--jobs", jobs)
    reports = json.loads(out)
    got = {os.path.basename(r["capture"]).removesuffix(".safetensors"): r["verdict"] for r in reports}
    assert got == EXPECTED
    assert code == 2, "the worst wins"
    lines = error_lines(err)
    bad = [ln for ln in lines if ln.startswith("refmla: error:")]
    assert len(bad) == 3 and "Traceback" not in err
    for name in ("b-heads0", "c-badmeta", "e-fifo"):
        assert sum(name in ln for ln in bad) == 1
    fifo = next(r for r in reports if "e-fifo" in r["capture"])
    assert "not a regular file" in fifo["error"]


def test_files_given_one_by_one_in_that_order(mixed):
    files = [str(mixed / f"{n}.safetensors") for n in ("a-good", "b-heads0", "c-badmeta")]
    code, out, err = run_cli("replay", *files, "--backend", "reference", "--json")
    assert [r["verdict"] for r in json.loads(out)] == ["agree", "invalid", "invalid"] and code == 2


def test_a_name_too_long_for_the_filesystem_is_an_invalid_capture(mixed):
    long = str(mixed / ("y" * 300 + ".safetensors"))
    code, out, err = run_cli("replay", str(mixed / "a-good.safetensors"), long, "--backend", "reference", "--json")
    reports = json.loads(out)
    assert [r["verdict"] for r in reports] == ["agree", "invalid"] and code == 2
    bad = [ln for ln in error_lines(err) if ln.startswith("refmla: error:")]  # the others: progress
    assert len(bad) == 1 and "name too long" in bad[0].lower()


def test_inspect_of_a_folder_puts_each_reason_on_stderr(mixed):
    code, out, err = run_cli("inspect", str(mixed))
    bad = [ln for ln in error_lines(err) if ln.startswith("refmla: error:")]
    assert code == 2 and len(bad) == 3
    assert all(any(n in ln for ln in bad) for n in ("b-heads0", "c-badmeta", "e-fifo"))
    code, out, err = run_cli("inspect", str(mixed), "--json")
    assert len(json.loads(out)) == 5


@pytest.mark.parametrize("value", ["0", "-3", "two"])
def test_jobs_must_be_a_positive_integer(mixed, value):
    code, out, err = run_cli("replay", str(mixed / "a-good.safetensors"), "--jobs", value)
    assert code == 2 and len(error_lines(err)) == 1 and "--jobs" in err and out == ""


@pytest.mark.parametrize("option,value", [("--k", "nan"), ("--ulps", "-1"), ("--cos", "inf"), ("--k", "x")])
def test_tolerance_options_must_be_finite_and_non_negative(mixed, option, value):
    """A NaN tolerance would judge nothing (every comparison false): a usage error, not a replay."""
    code, out, err = run_cli("replay", str(mixed / "a-good.safetensors"), f"{option}={value}")
    assert code == 2 and len(error_lines(err)) == 1 and option in err and out == ""


def test_an_unexpected_error_names_the_file(tmp_path, monkeypatch):
    import refmla.cli.diffkv as cli_diffkv

    def boom(*a, **k):
        raise RuntimeError("kaboom")

    monkeypatch.setattr(cli_diffkv, "diff_kv_files", boom)
    a = str(write_small(tmp_path / "p.safetensors"))
    code, out, err = run_cli("diff-kv", a, a)
    assert code == 2 and error_lines(err) == [ln for ln in error_lines(err) if a in ln and "RuntimeError" in ln]
    assert len(error_lines(err)) == 1
    code, out, err = run_cli("diff-kv", a, a, "--json")
    assert code == 2 and json.loads(out)["ok"] is False and "kaboom" in json.loads(out)["error"]


def test_a_crashing_hypothesis_search_does_not_crash_the_replay(tmp_path, monkeypatch):
    import refmla.hypotheses as hyp

    def boom(s):
        raise ZeroDivisionError("float division by zero")

    monkeypatch.setitem(hyp.SEARCHES, "seq_len_off_by", boom)
    path = write_small(tmp_path / "f.safetensors", lambda t, m: t["out"].mul_(1.5))
    code, out, err = run_cli("replay", str(path), "--backend", "reference", "--json")
    obs = json.loads(out)["backends"]["observed"]
    assert code == 1 and obs["status"] == "fail"
    assert "ZeroDivisionError" in obs["info"]["hypothesis_errors"]["seq_len_off_by"]  # that family's error


@pytest.mark.parametrize("dv,rope", [(32, 64), (512, 16)])
def test_a_shape_the_triton_kernel_does_not_support_is_skipped_with_its_constraint(tmp_path, dv, rope):
    from refmla.backends import get_backend
    from refmla.backends.triton import unsupported_shape

    assert unsupported_shape(512, 64) is None and unsupported_shape(256, 32) is None and unsupported_shape(64, 0) is None
    ok, why = get_backend("triton").availability()
    if not ok:
        pytest.skip(f"triton backend unavailable: {why}")
    spec = SMALL.__class__(**{**SMALL.__dict__, "kv_lora_rank": dv, "qk_rope_head_dim": rope})
    path = write_small(tmp_path / "c.safetensors", spec=spec)
    code, out, err = run_cli("replay", str(path), "--backend", "triton", "--json")
    r = json.loads(out)
    tri = r["backends"]["triton"]
    assert tri["status"] == "skipped" and f"{dv} + {rope}" in tri["reason"], tri
    assert code == 3 and r["verdict"] == "agree"  # the backend asked for did not run (issue 29): exit 3, one line
    assert "backend triton was asked for and did not run" in err


# --- diff-kv -----------------------------------------------------------------------------------


def _empty_requests(t, m):
    """Both requests attend nothing: kv_indptr all zero, no indices."""
    B = t["seq_lens"].shape[0]
    t["kv_indptr"] = torch.zeros(B + 1, dtype=torch.int32)
    t["kv_indices"] = torch.zeros(0, dtype=torch.int32)
    t["seq_lens"] = torch.zeros(B, dtype=torch.int32)
    t["num_kv_splits"] = torch.ones(B, dtype=torch.int32)


def test_diff_kv_comparing_zero_positions_is_not_a_match(tmp_path):
    a = str(write_small(tmp_path / "p.safetensors", _empty_requests))
    code, out, err = run_cli("diff-kv", a, a, "--json")
    doc = json.loads(out)
    assert code == 2 and doc["ok"] is False and doc["positions_compared"] == 0
    assert "nothing compared" in doc["error"]
    assert {e["status"] for e in doc["requests"]} == {"nothing_compared"}
    assert len(error_lines(err)) == 1 and a in err
    code, out, err = run_cli("diff-kv", a, a)
    assert code == 2 and "NOTHING COMPARED" in out


def test_diff_kv_json_prints_a_document_when_the_input_is_invalid(tmp_path):
    good = str(write_small(tmp_path / "p.safetensors"))
    bad = str(write_small(tmp_path / "d.safetensors", _no_heads))
    code, out, err = run_cli("diff-kv", good, bad, "--json")
    doc = json.loads(out)
    assert code == 2 and doc["ok"] is False and bad in doc["error"] and doc["decode"] == bad
    assert len(error_lines(err)) == 1


def test_diff_kv_of_identical_captures_still_matches(tmp_path):
    a = str(write_small(tmp_path / "p.safetensors"))
    code, out, err = run_cli("diff-kv", a, a, "--json")
    doc = json.loads(out)
    assert code == 0 and doc["ok"] and doc["positions_compared"] == 47 and "error" not in doc
