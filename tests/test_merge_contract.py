"""Where writers and mergers meet: one lse_base spelled either way, the rows where both pieces are
empty as the real merges produce them, a merge that forgot to renormalise.

Test data: vLLM's own ``_merge_attn_states_torch`` (read from the installed vllm at run time) for the
clean merges, this file's plain loop for the planted unnormalised one; vLLM's and SGLang's Triton
merges interpreted on the CPU as backends."""

from __future__ import annotations

import json
import math

import pytest
import torch

from refmla.cli import main as refmla_main
from refmla.options import ReplayOptions
from refmla.pipeline import replay_file

T, H, D = 5, 3, 32


def vllm_torch_merge():
    try:
        from vllm.v1.attention.ops.merge_attn_states import _merge_attn_states_torch
    except Exception as e:
        pytest.skip(f"vllm's torch merge not importable: {type(e).__name__}: {e}")
    return _merge_attn_states_torch


def pieces(seed: int = 0, both_empty_row: bool = True):
    """Two pieces' (out [T, H, D] bf16, natural lse [T, H]); row 0's prefix is empty, and row 1 has
    no keys in either piece when ``both_empty_row`` (out 0, lse -inf both)."""
    g = torch.Generator().manual_seed(seed)
    out = [torch.randn(T, H, D, generator=g).bfloat16() for _ in range(2)]
    lse = [torch.randn(T, H, generator=g) * 3 for _ in range(2)]
    out[0][0], lse[0][0] = 0, -math.inf
    if both_empty_row:
        for i in range(2):
            out[i][1], lse[i][1] = 0, -math.inf
    return out[0], lse[0], out[1], lse[1]


def by_vllm(oa, la, ob, lb):
    """vLLM's torch merge (its lse [H, T]): (out [T, H, D], lse [T, H])."""
    out, lse = torch.empty_like(oa), torch.empty(H, T)
    vllm_torch_merge()(out, oa, la.t().contiguous(), ob, lb.t().contiguous(), lse)
    return out, lse.t()


def write(path, oa, la, ob, lb, out, lse, base):
    from safetensors.torch import save_file

    t = {"out_a": oa, "lse_a": la.float(), "out_b": ob, "lse_b": lb.float(), "out": out, "lse": lse.float()}
    meta = {"mode": "merge", "merger": "vllm.merge_attn_states", "lse_base": base}
    save_file({k: v.contiguous() for k, v in t.items()}, str(path),
              metadata={"format": "refmla.capture/1", "meta": json.dumps(meta)})  # fmt: skip
    return str(path)


@pytest.mark.parametrize("base", ["e", "ln", "2", "log2"])
def test_either_spelling_of_the_lse_base_is_read_as_the_same_base(tmp_path, base):
    oa, la, ob, lb = pieces(both_empty_row=False)
    out, lse = by_vllm(oa, la, ob, lb)
    if base in ("2", "log2"):  # the same merge, its lse recorded in log2
        la, lb, lse = la / math.log(2), lb / math.log(2), lse / math.log(2)
    path = write(tmp_path / "m.safetensors", oa, la, ob, lb, out, lse, base)
    r = replay_file(path, ReplayOptions(backends=[]))
    assert r.verdict == "agree", r.diagnosis_text
    assert r.meta.lse_base == {"e": "e", "ln": "e", "2": "2", "log2": "2"}[base]
    assert refmla_main(["replay", path, "--backend", "reference"]) == 0


def test_an_unknown_lse_base_is_refused_naming_the_key(tmp_path, capsys):
    oa, la, ob, lb = pieces(both_empty_row=False)
    path = write(tmp_path / "m.safetensors", oa, la, ob, lb, *by_vllm(oa, la, ob, lb), "10")
    assert refmla_main(["replay", path]) == 2
    err = capsys.readouterr().err
    assert path in err and "meta key 'lse_base'" in err and "Traceback" not in err


@pytest.mark.parametrize("spelled,base", [("log2", "log2"), ("2", "log2"), ("ln", "ln"), ("e", "ln"), ("10", None)])
def test_a_decode_capture_reads_either_spelling_and_refuses_another(tmp_path, capsys, spelled, base):
    """A vLLM decode capture (tools/planting_vllm.py, vLLM's layout) whose lse is in the base it names."""
    from helpers import load_tool
    from refmla.capture import read_capture, write_capture

    pv = load_tool("planting_vllm")
    spec = pv.VllmSpec(block=16, fp8=False, seq_lens=(40, 17), heads=2)
    t, meta, _ = pv.capture(spec)
    if base == "log2":
        t["lse"] = t["lse"] / math.log(2)
    meta["lse_base"] = spelled
    path = tmp_path / "d.safetensors"
    if base is None:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in t.items()}, str(path),
                  metadata={"format": "refmla.capture/1", "meta": json.dumps(meta)})  # fmt: skip
        assert refmla_main(["replay", str(path), "--backend", "reference"]) == 2
        err = capsys.readouterr().err
        assert str(path) in err and "meta key 'lse_base'" in err and "Traceback" not in err
        return
    r = replay_file(write_capture(path, t, meta, compact=False), ReplayOptions(backends=["reference"]))
    assert r.backends["observed"].info["arithmetic"]["lse_base"] == base
    assert r.verdict == "agree", r.diagnosis_text


def test_a_merge_that_forgot_to_renormalise_is_named(tmp_path):
    oa, la, ob, lb = pieces(both_empty_row=False)
    out = torch.zeros(T, H, D, dtype=torch.float64)
    for t in range(T):  # the planted merger: weights exp(lse - max), never divided by their sum
        for h in range(H):
            m = max(float(la[t, h]), float(lb[t, h]))
            out[t, h] = math.exp(la[t, h] - m) * oa[t, h].double() + math.exp(lb[t, h] - m) * ob[t, h].double()
    _, lse = by_vllm(oa, la, ob, lb)
    r = replay_file(write(tmp_path / "m.safetensors", oa, la, ob, lb, out.bfloat16(), lse, "e"), ReplayOptions(backends=[]))
    e = r.backends["observed"].explanation
    assert r.diagnosis == "merge" and e.hypothesis == "merge_unnormalized" and e.detail == {"weights": "exp(lse - max)"}


def test_both_pieces_empty_rows_as_the_real_merges_give_them(tmp_path):
    """vLLM's torch merge writes out 0, lse -inf where both pieces are empty (the contract's row);
    SGLang's Triton merge gives NaN there, named merge_both_empty_nan in the diagnosis."""
    oa, la, ob, lb = pieces()
    out, lse = by_vllm(oa, la, ob, lb)
    assert bool((out[1] == 0).all()) and bool((lse[1] == -math.inf).all())
    r = replay_file(write(tmp_path / "m.safetensors", oa, la, ob, lb, out, lse, "e"), ReplayOptions())
    assert r.backends["observed"].status == "pass"
    sg, vl = r.backends["sglang_triton_merge"], r.backends["vllm_triton_merge"]
    if "skipped" in (sg.status, vl.status):
        pytest.skip(f"a Triton merge is not runnable here: {sg.reason or vl.reason}")
    assert vl.status == "pass"
    assert sg.status == "fail" and sg.explanation.hypothesis == "merge_both_empty_nan"
    assert sg.explanation.detail["rows"] == [1] and sg.explanation.detail["pairs"] == H
    assert r.diagnosis == "merge_kernel" and "sglang_triton_merge give NaN" in r.diagnosis_text


def test_production_nan_on_both_empty_rows_is_named(tmp_path):
    oa, la, ob, lb = pieces()
    out, lse = by_vllm(oa, la, ob, lb)
    out[1], lse[1] = math.nan, math.nan  # what SGLang's Triton merge writes there
    r = replay_file(write(tmp_path / "m.safetensors", oa, la, ob, lb, out, lse, "e"), ReplayOptions(backends=[]))
    e = r.backends["observed"].explanation
    assert r.diagnosis == "merge" and e.hypothesis == "merge_both_empty_nan" and e.detail["rows"] == [1]
