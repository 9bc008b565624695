"""`refmla synth` makes a capture showing each class of the bytes between writer and reader, and the
replay names it (docs/kv-bytes.md). The planting is each kind's own loop (refmla.synthetic.kv_bytes_faults
over blocktable_faults.attend, refmla.kvwrite.synth / packed_synth, refmla.sparse.byte_faults), never
the reference, decoder or search the replay measures with."""

from __future__ import annotations

import pytest

from refmla.api import replay, synth

DENSE = [("kv_fp8_encoding_mismatch", {"written": "float8_e4m3fn", "read": "float8_e4m3fnuz"}),
         ("kv_scale_format", {"read": "ue8m0", "value_read": 2.0**-7}),
         ("kv_page_stride", {"stride": 8 * 1152, "page_stride": 16 * 1152, "cache": "kv"})]  # fmt: skip


@pytest.mark.parametrize("fault,detail", DENSE)
def test_dense_faults(tmp_path, fault, detail):
    path = tmp_path / "d.safetensors"
    synth(path, "kimi-k2-tp8", fault)
    r = replay(path, backends=["reference"])
    e = r.backends["observed"].explanation
    assert e is not None and e.hypothesis == fault, r.diagnosis_text
    assert {k: e.detail[k] for k in detail} == detail and r.diagnosis == "kv_contract"


WRITER = [("kv-write-fp8", "encoding_mismatch", "kv_fp8_encoding_mismatch", "kv_contract"),
          ("kv-write-fp8-fnuz", "cast_overflow", "kv_cast_overflow", "kv_saturated"),
          ("kv-write-fp8", "scale_format", "kv_scale_format", "kv_contract"),
          ("kv-write-fp8", "scale_other_value", "kv_scale_other_value", "kv_writer"),
          ("kv-write-bf16", "tokens_not_written", "kv_tokens_not_written", "kv_writer"),
          ("kv-write-bf16", "rope_stale", "kv_rope_stale", "kv_writer"),
          ("kv-write-fp8", "stale_rows", "kv_written_to_stale_rows", "kv_writer"),
          ("kv-write-v4-fnuz", "cast_overflow", "kv_cast_overflow", "kv_saturated")]  # fmt: skip


@pytest.mark.parametrize("preset,fault,name,diagnosis", WRITER)
def test_writer_faults(tmp_path, preset, fault, name, diagnosis):
    path = tmp_path / "w.safetensors"
    synth(path, preset, fault)
    r = replay(path)
    e = r.backends["observed"].explanation
    assert e is not None and e.hypothesis == name and r.diagnosis == diagnosis, r.diagnosis_text


@pytest.mark.parametrize("preset", ["kv-write-fp8", "kv-write-bf16"])
def test_cast_overflow_needs_an_e4m3fnuz_preset(tmp_path, preset):
    with pytest.raises(ValueError, match="e4m3fnuz|fp8 preset"):
        synth(tmp_path / "w.safetensors", preset, "cast_overflow")


def test_v32_fp32_scales_read_as_ue8m0(tmp_path):
    """SGLang's V3.2 store keeps amax / 448 (not a power of two): read as UE8M0 it is named; the
    same preset without the fault agrees."""
    path = tmp_path / "s.safetensors"
    synth(path, "deepseek-v3.2-tp8-sglang", "none")
    assert replay(path, backends=["reference", "observed"]).verdict == "agree"
    synth(path, "deepseek-v3.2-tp8-sglang", "kv_scale_format")
    r = replay(path, backends=["reference", "observed"])
    e = r.backends["observed"].explanation
    assert e is not None and e.hypothesis == "kv_scale_format", r.diagnosis_text
    assert e.detail == {"stored": "fp32", "read": "ue8m0", "how": "its exponent (rounded down to a power of two)",
                        "cache": "main"}  # fmt: skip
