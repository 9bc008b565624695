"""Issue 12, findings are never a pass: everything the capture says production produced (out, lse,
split partials) is judged, and a failing part makes the verdict `diverged` with the part named."""

import json
import math

import pytest
import torch

from hostile import SMALL, error_lines, run_cli, small_capture, write_small
from helpers import raw_write
from refmla import reference as ref
from refmla.scales import Scales
from refmla.attended import Attended


def with_parts(t, m):
    """Add what a correct production kernel stores: lse and the stage-1 partials (fp32, no v_scale)."""
    sc = Scales(512, m["sm_scale"], m["logit_cap"], m["k_scale"])
    args = (t["q"], t["kv_buffer"], Attended.from_tensors(t))
    _, lse = ref.mla_decode_ref(*args, sc.but(v_scale=m["v_scale"]))
    parts, lses, _ = ref.mla_decode_split_ref(*args, t["num_kv_splits"], sc, max_kv_splits=m["max_kv_splits"])
    t["lse"], t["attn_logits"], t["attn_lse"] = lse.float(), parts.float(), lses.float()


def _replay(path):
    code, out, err = run_cli("replay", str(path), "--backend", "reference", "--json")
    return code, json.loads(out), err


def test_correct_parts_agree(tmp_path):
    code, r, err = _replay(write_small(tmp_path / "c.safetensors", with_parts))
    obs = r["backends"]["observed"]
    assert code == 0 and r["verdict"] == "agree", err
    assert obs["lse"]["status"] == "pass" and obs["lse"]["compared_rows"] == 2
    assert obs["splits"]["status"] == "pass" and obs["splits"]["compared_splits"] == 3


@pytest.mark.parametrize("where", ["attn_logits", "attn_lse", "lse"])
@pytest.mark.parametrize("bad", [math.nan, 0.5])
def test_a_bad_part_is_a_divergence_named_in_the_diagnosis(tmp_path, where, bad):
    def mutate(t, m):
        with_parts(t, m)
        if where == "attn_logits":
            t[where][0, 1, 1, 7] += bad if not math.isnan(bad) else 0.0
            if math.isnan(bad):
                t[where][0, 1, 1, 7] = bad  # a NaN split partial (aiter #4420 / #3641 class)
        elif math.isnan(bad):
            t[where].view(-1)[1] = bad
        else:
            t[where].view(-1)[1] += bad

    code, r, err = _replay(write_small(tmp_path / "c.safetensors", mutate))
    obs = r["backends"]["observed"]
    part = "lse" if where == "lse" else "attn_logits"
    assert code == 1 and r["verdict"] == "diverged", (where, bad, obs)
    assert obs["status"] == "fail" and obs["failed_parts"] == [part]
    assert obs["passed"] is True  # `out` itself is right: only the part is wrong
    assert r["diagnosis"] == "observed_unconfirmed"
    assert ("lse" if where == "lse" else "split partials") in r["diagnosis_text"]
    assert ("lse" if where == "lse" else "split partials") in obs["reason"]


def test_nan_lse_of_an_empty_request_is_not_compared(tmp_path):
    """A production kernel leaves a zero-length request's row undefined: its lse is not judged."""
    from refmla.synthetic import preset

    spec = preset("hostile", num_heads=2, seq_lens=(37, 0, 5), num_kv_splits=(2, 1, 1), max_kv_splits=4)

    def mutate(t, m):
        with_parts(t, m)
        t["lse"][1] = math.nan

    code, r, err = _replay(write_small(tmp_path / "c.safetensors", mutate, spec=spec))
    assert code == 0, r["backends"]["observed"]
    assert r["backends"]["observed"]["lse"]["compared_rows"] == 2


def test_golden_check_fails_on_a_tampered_split_partial(tmp_path):
    """`golden check` (the kernel-regression suite's own check of a golden file) must catch +0.5 on one partial."""
    from pathlib import Path

    from safetensors import safe_open

    from refmla.golden import check

    src = sorted(Path(__file__).resolve().parents[1].joinpath("golden").glob("kimi-h8-len1-31*.safetensors"))[0]
    with safe_open(str(src), "pt") as f:
        t = {k: f.get_tensor(k) for k in f.keys()}
        header = f.metadata()
    t["attn_logits"][2, 0, 0, 5] += 0.5
    dst = tmp_path / src.name
    raw_write(dst, t, header["meta"])
    entry = check(dst, "reference").entry
    assert entry.status == "fail" and "split partials" in (entry.reason or ""), entry
    replayed = run_cli("replay", str(dst), "--backend", "reference", "--json")  # the stored partials as observed
    assert replayed[0] == 1 and "split partials" in json.loads(replayed[1])["diagnosis_text"]


@pytest.mark.parametrize("shift,code_want", [(0.0, 0), (1.0, 1)])
def test_fp8_pool_lse_allows_either_q_rounding_but_not_more(tmp_path, shift, code_want):
    """An fp8 pool: a kernel may or may not round q's latent part to fp8 (the Triton decode kernel
    does, an extend kernel may not); the exact lse passes, one off by 1.0 does not."""
    import dataclasses

    spec = dataclasses.replace(SMALL, kv_dtype=torch.float8_e4m3fn, k_scale=0.5, v_scale=0.5)

    def mutate(t, m):
        with_parts(t, m)
        t["lse"] += shift

    code, r, err = _replay(write_small(tmp_path / "c.safetensors", mutate, spec=spec))
    assert code == code_want, r["backends"]["observed"]
    assert r["backends"]["observed"]["lse"]["status"] == ("pass" if code_want == 0 else "fail")
