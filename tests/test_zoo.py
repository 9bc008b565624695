"""The zoo of faults from real MLA kernel bugs (refmla.synthetic.zoo): each is planted, replayed end to
end through `refmla replay --json`, and named by its hypothesis with the detail a kernel engineer
needs; planting refuses presets where the fault cannot exist."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from refmla.attended import Attended
from refmla.cli import main as cli
from refmla.scales import Scales
from refmla.synthetic import preset, synth_capture
from refmla.synthetic.faults import EXPECT

PAGE256 = preset("kimi-k2-tp8-page256")  # seq_lens (611, 257, 1300, 33), fault on request 2
DSV3 = preset("deepseek-v3-tp8")  # 16 heads, page 64, seq_lens (700, 129, 1024, 1)


@pytest.fixture(autouse=True)
def torch_extend(monkeypatch):
    monkeypatch.setenv("REFMLA_EXTEND_IMPL", "torch")  # the Triton extend is tested in test_extend.py


def replay(tmp_path, capsys, spec, fault: str) -> tuple[dict, dict]:
    """Plant ``fault`` on ``spec``, replay it (reference, observed, extend); (observed entry, planted)."""
    path = tmp_path / f"{spec.name}-{fault}.safetensors"
    planted = synth_capture(path, spec, fault)
    code = cli(["replay", str(path), "--json", "--backend", "extend"])
    report = json.loads(capsys.readouterr().out)
    assert code == 1 and report["verdict"] == "diverged", report
    assert report["diagnosis"] == "observed" and report["backends"]["extend"]["status"] == "pass"
    obs = report["backends"]["observed"]
    assert obs["status"] == "fail" and "explanation" in obs, obs
    e = obs["explanation"]
    assert e["hypothesis"] == EXPECT[fault], e
    assert e["residual_ratio"] <= 1.0
    return obs, planted


@pytest.mark.parametrize("spec", [PAGE256, DSV3], ids=lambda s: s.name)
def test_last_page_read_full(tmp_path, capsys, spec):
    obs, planted = replay(tmp_path, capsys, spec, "last_page_read_full")
    e = obs["explanation"]
    b = planted["request"]
    L = spec.seq_lens[b]
    P = spec.page_size
    assert e["request"] == b == obs["worst"]["request"]
    assert e["detail"] == {"page": (L - 1) // P, "rows_read": -(-L // P) * P, "rows_expected": L}
    assert e["detail"]["rows_read"] - L > 4  # more than seq_len_off_by could reach
    assert "requests" not in e


@pytest.mark.parametrize("spec", [PAGE256, DSV3], ids=lambda s: s.name)
def test_last_page_len_swapped(tmp_path, capsys, spec):
    obs, planted = replay(tmp_path, capsys, spec, "last_page_len_swapped")
    e = obs["explanation"]
    b, o = planted["request"], planted["from_request"]
    P, L = spec.page_size, spec.seq_lens[b]
    last = spec.seq_lens[o] - ((spec.seq_lens[o] - 1) // P) * P
    assert e["request"] == b and e["detail"]["from_request"] == o == (b + 1) % len(spec.seq_lens)
    assert e["detail"]["last_page_len"] == last == planted["last_page_len"]
    assert e["detail"]["rows_read"] == ((L - 1) // P) * P + last and e["detail"]["rows_expected"] == L
    assert e["expected_last_page_len"] == L - ((L - 1) // P) * P


@pytest.mark.parametrize("fault", ["last_page_read_full", "last_page_len_swapped"])
def test_page_faults_need_pages(tmp_path, capsys, fault):
    code = cli(["synth", str(tmp_path / "x.safetensors"), "--preset", "kimi-k2-tp8", "--fault", fault])
    err = capsys.readouterr().err
    assert code == 2 and "page_size > 1" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("spec", [preset("kimi-k2-tp8"), PAGE256, DSV3], ids=lambda s: s.name)
def test_empty_split_merged_nan(tmp_path, capsys, spec):
    obs, planted = replay(tmp_path, capsys, spec, "empty_split_merged")
    e = obs["explanation"]
    assert e["request"] == planted["request"] == obs["worst"]["request"]
    assert e["detail"]["split"] == planted["split"] and e["empty_splits"] == planted["empty_splits"]
    assert e["detail"]["num_kv_splits"] == spec.max_kv_splits and e["detail"]["went_in"].startswith("NaN")
    assert e["schedule"] == "capture"


def test_empty_split_merged_zero_scratch(tmp_path, capsys):
    """Zero-initialized scratch (partial 0, lse 0) merged in: the output shrinks toward 0, seen where
    the request's lse is small (flat logits, a short request)."""
    from refmla import reference as ref
    from refmla.capture import write_capture
    from refmla.synthetic import faulty_output, make_inputs, make_meta

    spec = dataclasses.replace(preset("kimi-k2-tp8"), name="flat", sm_scale=0.01, fault_request=3)
    t = make_inputs(spec)
    out, _ = faulty_output(spec, t, "none")
    b, n = 3, spec.max_kv_splits  # request 3: 33 tokens, 16 splits of 32: 14 empty
    t["num_kv_splits"][b] = n
    sc = dict(kv_lora_rank=512, sm_scale=spec.sm_scale)
    parts, lses, valid = ref.mla_decode_split_ref(t["q"], t["kv_buffer"], Attended.token_index(t["kv_indptr"], t["kv_indices"]), t["num_kv_splits"], Scales(**sc), max_kv_splits=n)  # fmt: skip
    lses[b, :, ~valid[b]] = 0.0  # parts stay 0
    valid[b] = True
    out[b] = ref.merge_splits(parts, lses, valid)[0][b].to(out.dtype)
    t["out"] = out
    path = tmp_path / "zero-scratch.safetensors"
    write_capture(path, t, make_meta(spec), compact=False)
    code = cli(["replay", str(path), "--json", "--backend", "extend"])
    e = json.loads(capsys.readouterr().out)["backends"]["observed"]["explanation"]
    assert code == 1 and e["hypothesis"] == "empty_split_merged" and e["request"] == b
    assert e["detail"] == {"split": 2, "num_kv_splits": n, "went_in": "zero partial, lse 0 (zero-initialized scratch)"}
    assert e["empty_splits"] == list(range(2, n))


@pytest.mark.parametrize("spec", [preset("kimi-k2-tp8"), PAGE256], ids=lambda s: s.name)
def test_offset_overflow_reads_the_wrapped_row(tmp_path, capsys, spec):
    obs, planted = replay(tmp_path, capsys, spec, "offset_overflow")
    e = obs["explanation"]
    first = -(-(2**32) // (576 * 2))  # bf16 rows: the first slot whose uint32 byte offset wraps
    assert first == 3728271 and e["first_wrapping_slot"] == first == planted["first_wrapping_slot"]
    assert e["request"] == planted["request"]
    slot = e["detail"]["first_slot"]
    assert slot == planted["first_slot"] >= first and e["detail"]["position"] == planted["position"]
    assert e["detail"]["offset"] == "slot * 576 * 2 bytes in uint32"
    off = slot * 1152 % 2**32  # the exact wrap: which slot, which byte
    assert e["detail"]["reads"] == f"slots {off // 1152} (from byte {off % 1152}) and {off // 1152 + 1}"
    assert e["wrapped_positions"] == planted["wrapped_positions"] > 0


def test_offset_overflow_reads_zeros(tmp_path, capsys):
    """Slots past the wrap whose wrapped rows the capture does not hold, read as zeros (a
    never-written slot of a zero-initialized pool): named, with the first wrapped slot."""
    from refmla.capture import write_capture
    from refmla.synthetic import faulty_output, make_inputs, make_meta

    spec = preset("kimi-k2-tp8")
    t = make_inputs(spec)
    b, lo, hi = 2, int(t["kv_indptr"][2]), int(t["kv_indptr"][3])
    phys = t["kv_indices"].long() + 2**20
    phys[lo:hi] = 3728271 - 700 + torch.arange(hi - lo)  # positions 700.. are past the wrap
    t["orig_kv_indices"] = phys
    kvz = t["kv_buffer"].clone()
    kvz[t["kv_indices"][lo + 700 : hi].long()] = 0
    out, _ = faulty_output(spec, t, "none")
    out[b] = faulty_output(spec, {**t, "kv_buffer": kvz}, "none")[0][b]
    t["out"] = out
    path = tmp_path / "wrap-zeros.safetensors"
    write_capture(path, t, make_meta(spec), compact=False)
    code = cli(["replay", str(path), "--json", "--backend", "extend"])
    e = json.loads(capsys.readouterr().out)["backends"]["observed"]["explanation"]
    assert code == 1 and e["hypothesis"] == "offset_overflow" and e["request"] == b, e
    assert e["detail"]["first_slot"] == 3728271 and e["detail"]["position"] == 700
    assert e["detail"]["reads"].startswith("zeros") and e["wrapped_positions"] == 1024 - 700


@pytest.mark.parametrize("fault,scale,applied", [("k_scale_twice", "k_scale", "twice"),
                                                 ("v_scale_missing", "v_scale", "not at all")])  # fmt: skip
def test_kv_scale_misapplied(tmp_path, capsys, fault, scale, applied):
    """Planted on an fp8 version of the preset; k_scale twice is named as the fp8 scale, not as a
    softmax scale off by the same ratio (the explanation says why)."""
    from refmla.capture import read_capture

    obs, planted = replay(tmp_path, capsys, preset("kimi-k2-tp8"), fault)
    cap = read_capture(tmp_path / f"kimi-k2-tp8-{fault}.safetensors")
    assert cap.kv_buffer.dtype == torch.float8_e4m3fn and cap.meta.k_scale == cap.meta.v_scale == 0.5
    assert planted["pool"] == "kimi-k2-tp8-fp8"
    e = obs["explanation"]
    assert e["detail"] == {"scale": scale, "applied": applied} and e["scope"] == "all requests"
    assert (e["k_scale_used"], e["v_scale_used"]) == ((0.25, 0.5) if scale == "k_scale" else (0.5, 1.0))
    if scale == "k_scale":
        assert "wrong_sm_scale(ratio=0.5)" in e["why"]


def test_fp8_range_zeroed_is_named(tmp_path, capsys):
    """Zeroing rows of an fp8 pool (no masked_fill for fp8) works: the zeroed range is named."""
    spec = dataclasses.replace(preset("kimi-k2-tp8"), name="fp8-flat", sm_scale=0.01, kv_dtype=torch.float8_e4m3fn,
                               k_scale=0.5, v_scale=0.5)  # fmt: skip
    obs, planted = replay(tmp_path, capsys, spec, "kv_range_zero")
    e = obs["explanation"]
    assert e["request"] == planted["request"] and (e["detail"]["start"], e["detail"]["end"]) == (32, 64)
    assert "zeroed" in e["detail"]["how"]


@pytest.mark.parametrize("fault,how", [("rope_ignored", "rope ignored"), ("rope_swapped", "q rope and latent swapped")])
@pytest.mark.parametrize("spec", [preset("kimi-k2-tp8"), DSV3], ids=lambda s: s.name)
def test_rope_mishandled(tmp_path, capsys, spec, fault, how):
    obs, planted = replay(tmp_path, capsys, spec, fault)
    e = obs["explanation"]
    assert e["detail"] == {"how": how} == {"how": planted["how"]} and e["scope"] == "all requests"
    assert (e["kv_lora_rank"], e["qk_rope_head_dim"]) == (512, 64)


def test_zoo_faults_registered_with_their_hypothesis():
    from refmla.hypotheses import HYPOTHESES
    from refmla.synthetic.zoo import __doc__ as zoo_doc

    zoo = ["last_page_read_full", "last_page_len_swapped", "empty_split_merged", "offset_overflow", "k_scale_twice",
           "v_scale_missing", "rope_ignored", "rope_swapped"]  # fmt: skip
    for name in zoo:
        assert EXPECT[name] in HYPOTHESES and name in zoo_doc, name


def test_empty_split_refuses_extend(tmp_path, capsys):
    code = cli(["synth", str(tmp_path / "x.safetensors"), "--preset", "kimi-k2-tp8-extend", "--fault",
                "empty_split_merged"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and "extend" in err and len(err.strip().splitlines()) == 1


def test_offset_overflow_fp8_pool_wraps_at_its_own_slot(tmp_path, capsys):
    """576-byte fp8 rows wrap a uint32 byte offset at slot 7456541, not bf16's 3728271; slots
    between the two do not wrap (the int32 element offset would, and it is not what was planted)."""
    spec = dataclasses.replace(preset("kimi-k2-tp8"), name="fp8", kv_dtype=torch.float8_e4m3fn, k_scale=0.5,
                               v_scale=0.5)  # fmt: skip
    obs, planted = replay(tmp_path, capsys, spec, "offset_overflow")
    e = obs["explanation"]
    assert e["first_wrapping_slot"] == planted["first_wrapping_slot"] == -(-(2**32) // 576) == 7456541
    assert e["detail"]["offset"] == "slot * 576 * 1 bytes in uint32"
    slot = e["detail"]["first_slot"]
    off = slot * 576 % 2**32
    assert slot == planted["first_slot"] and e["detail"]["reads"] == f"slots {off // 576} (from byte {off % 576}) and {off // 576 + 1}"


EXISTING = ["kv_range_missing", "kv_range_zero", "split_missing", "wrong_sm_scale", "head_misaligned", "logit_cap_mismatch"]


@pytest.mark.parametrize("fault", EXISTING)
@pytest.mark.parametrize("spec", [PAGE256, DSV3], ids=lambda s: s.name)
def test_existing_faults_still_named_on_paged_presets(tmp_path, capsys, spec, fault):
    """With the zoo's families in the search (the page families active at page_size > 1), the
    contract's faults keep their hypothesis and request."""
    obs, planted = replay(tmp_path, capsys, spec, fault)
    if "request" in planted:
        assert obs["explanation"]["request"] == planted["request"]


def test_scale_faults_refuse_unscaled_inputs():
    """faulty_output on inputs made without the fault's spec (k_scale 1) would plant nothing: refused."""
    from refmla.synthetic import faulty_output, make_inputs

    spec = preset("hostile")
    with pytest.raises(ValueError, match="k_scale"):
        faulty_output(spec, make_inputs(spec), "k_scale_twice")
