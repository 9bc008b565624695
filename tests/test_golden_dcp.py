"""The context-parallel golden (golden/dcp/): a clean kernel passes it; a kernel whose result on one
rank is wrong fails it, naming the rank; a stored combine that diverges fails the self-check; the
folder replays as one step; generate never overwrites a user's file.

The kernels here are this file's own (plain fp32 PyTorch attention over a vLLM block table), not
refmla's reference: the faults are planted in what they return."""

from __future__ import annotations

import hashlib
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from refmla.atomic import WriteError
from refmla.backends import named
from refmla.capture import read_capture, write_capture
from refmla.cli import main
from refmla.golden import dcp
from refmla.golden.suite import generate_all
from refmla.kernel import KernelOutputs, declare

DCP_DIR = Path(__file__).resolve().parents[1] / "golden" / "dcp"
CASE = next(iter(dcp.CASES))


def _attention(inputs, drop_last_on_rank1: bool = False, lse_shift: float = 0.0):
    """fp32 attention of each request over its block-table rows; out in the buffer's dtype, lse natural.
    Rank 1 of the golden step is the rank that holds none of request 2 (its length there is 0)."""
    q, kv, P = inputs.q.float(), inputs.kv_buffer[:, 0].float(), inputs.page_size
    B, H, _ = q.shape
    Dv = inputs.kv_lora_rank
    rank1 = B > 2 and int(inputs.seq_lens[2]) == 0
    out = torch.zeros(B, H, Dv)
    lse = torch.full((B, H), -math.inf)
    for b in range(B):
        L = int(inputs.seq_lens[b]) - (1 if drop_last_on_rank1 and rank1 and b == 0 else 0)
        if L <= 0:
            continue
        j = torch.arange(L)
        rows = inputs.block_table[b].long()[j // P] * P + j % P
        k = kv[rows]  # [L, D]
        s = (q[b] @ k.T) * inputs.sm_scale  # [H, L]
        lse[b] = torch.logsumexp(s, -1)
        out[b] = torch.softmax(s, -1) @ k[:, :Dv]
    shift = lse_shift if rank1 else 0.0
    return KernelOutputs(out=out.to(inputs.out.dtype), lse=lse + shift)


@declare(layout="block_table")
def clean_kernel(inputs):
    return _attention(inputs)


@declare(layout="block_table")
def dropping_kernel(inputs):  # rank 1 attends one position too few of request 0
    return _attention(inputs, drop_last_on_rank1=True)


@declare(layout="block_table")
def lse_kernel(inputs):  # rank 1's out right, its lse 0.5 too high: the combine weighs it wrong
    return _attention(inputs, lse_shift=0.5)


@pytest.fixture
def kernels():
    for n, fn in (("dcp_clean", clean_kernel), ("dcp_drop", dropping_kernel), ("dcp_lse", lse_kernel)):
        named.register(n, fn)
    yield
    for n in ("dcp_clean", "dcp_drop", "dcp_lse"):
        named.unregister(n)


def test_the_committed_case_matches_its_manifest():
    m = dcp.load_manifest(DCP_DIR)
    assert m["format"] == dcp.DCP_FORMAT and [c["name"] for c in m["cases"]] == list(dcp.CASES)
    for c in m["cases"]:
        for f in c["files"]:
            data = (DCP_DIR / c["folder"] / f["file"]).read_bytes()
            assert hashlib.sha256(data).hexdigest() == f["sha256"] and len(data) == f["bytes"], f["file"]


def test_reference_self_check_passes():
    r = dcp.check(DCP_DIR / CASE, "reference")
    assert r.status == "pass", r.message()


def test_a_clean_kernel_passes_on_every_rank_and_the_combine(kernels):
    r = dcp.check(DCP_DIR / CASE, "dcp_clean")
    assert r.status == "pass", r.message()
    assert r.entry.info["rows"] == {"rank 0": "pass", "rank 1": "pass", "combine": "pass"}


def test_a_wrong_result_on_one_rank_fails_the_golden_and_names_the_rank(kernels):
    r = dcp.check(DCP_DIR / CASE, "dcp_drop")
    assert r.status == "fail"
    assert r.entry.info["rows"]["rank 1"] == "fail" and r.entry.info["rows"]["rank 0"] == "pass"
    assert "rank 1" in r.message() and "refmla golden check" in r.message()
    found = r.entry.info["context_parallel"]["findings"]
    assert any(f["rank"] == 1 and f["request"] == 0 for f in found), found


def test_a_wrong_lse_on_one_rank_fails_the_golden(kernels):
    r = dcp.check(DCP_DIR / CASE, "dcp_lse")
    assert r.status == "fail"
    ranks = {e["rank"]: e for e in r.entry.info["context_parallel"]["ranks"]}
    assert ranks[1]["lse_bad"] > 0 and ranks[0]["lse_bad"] == 0
    assert f"rank 1: {ranks[1]['lse_bad']} (request, head) lse values off" in r.reason


def test_a_stored_combine_that_diverges_fails_the_self_check(tmp_path):
    case = tmp_path / CASE
    shutil.copytree(DCP_DIR / CASE, case)
    path = case / "rank1.safetensors"
    cap = read_capture(path)
    tensors = load_file(str(path))
    with safe_open(str(path), framework="pt") as f:
        meta = json.loads(f.metadata()["meta"])
    tensors["dcp_out"] = cap.dcp_out.clone()
    tensors["dcp_out"][0, 3] *= 1.01  # one head of the combine 1% off
    path.unlink()
    write_capture(path, tensors, meta, compact=False)
    r = dcp.check(case, "reference")
    assert r.status == "fail" and "combine on rank 1 (dcp_out)" in (r.reason or ""), r.message()
    assert "worst element: request 0 head 3" in r.message()


def test_the_case_folder_replays_as_one_step(capsys):
    code = main(["replay", str(DCP_DIR / CASE), "--json"])
    doc = json.loads(capsys.readouterr().out)
    doc = doc[0] if isinstance(doc, list) else doc
    assert code == 0 and doc["kind"] == "context_parallel" and doc["verdict"] == "agree"


def test_golden_check_cli_exit_codes(kernels, capsys):
    assert main(["golden", "check", str(DCP_DIR / CASE), "--backend", "reference"]) == 0
    assert main(["golden", "check", str(DCP_DIR), "--backend", "dcp_drop"]) == 1
    out = capsys.readouterr().out
    assert f"golden {CASE} / dcp_drop: FAIL" in out


def test_a_golden_folder_checks_its_dcp_cases(capsys):
    assert dcp.case_folders(DCP_DIR.parent) == [DCP_DIR / CASE]
    assert main(["golden", "check", str(DCP_DIR.parent), "--backend", "reference"]) == 0
    assert f"golden {CASE} / reference: PASS" in capsys.readouterr().out


@pytest.mark.parametrize("where", ["rank", "manifest"])
def test_generate_refuses_to_overwrite_a_users_file(tmp_path, where):
    user = tmp_path / "dcp" / CASE / "rank0.safetensors" if where == "rank" else tmp_path / "dcp" / "manifest.json"
    user.parent.mkdir(parents=True)
    user.write_bytes(b"my own notes\n")
    with pytest.raises(WriteError):
        dcp.generate(tmp_path / "dcp")
    with pytest.raises(WriteError):
        generate_all(tmp_path)  # the whole suite checks every target before it writes one
    assert user.read_bytes() == b"my own notes\n"
    assert not (tmp_path / "manifest.json").exists() and not list(tmp_path.glob("*.safetensors"))
