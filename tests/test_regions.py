"""The MR region-size check (refmla.regions) and the pool geometry the hook records (refmla.hook.geometry)."""

from __future__ import annotations

import json

import pytest
import torch

from refmla.capture import CaptureError, parse_meta
from refmla.cli import main
from refmla.hook.geometry import buffer_geometry, disagg_meta, pool_counts
from refmla.regions import DEFAULT_MR_LIMIT, check_region, fitting_tokens
from refmla.synth import preset, synth_capture

BASE = {"mode": "decode", "backend": "triton", "kv_lora_rank": 512, "qk_rope_head_dim": 64,
        "sm_scale": 0.1, "logit_cap": 0.0, "page_size": 64}  # fmt: skip


def meta(**geometry):
    return parse_meta({**BASE, **geometry})


def geometry_for(region_bytes: int, row_bytes: int = 1152, page: int = 64) -> dict:
    """Geometry whose region is the largest row multiple not above ``region_bytes``."""
    rows = region_bytes // row_bytes
    return {"kv_pool_rows": rows, "kv_pool_row_bytes": row_bytes, "kv_pool_layers_per_buffer": 1,
            "kv_pool_size": rows - page}  # fmt: skip


def test_over_the_default_limit_is_a_finding_with_the_numbers():
    rows = 3_500_000  # Kimi-K2 bf16 rows of 1152 bytes: 4.03 GB, the size that failed to register
    r = check_region(meta(kv_pool_rows=rows, kv_pool_row_bytes=1152, kv_pool_layers_per_buffer=1, kv_pool_size=rows - 64))
    assert r.status == "finding" and r.is_finding
    assert r.region_bytes == rows * 1152 and r.limit_bytes == DEFAULT_MR_LIMIT and r.limit_source == "default"
    fits = r.fits_max_total_num_tokens
    assert fits % 64 == 0 and (fits + 64) * 1152 < DEFAULT_MR_LIMIT <= (fits + 128) * 1152
    assert str(rows * 1152) in r.message and str(fits) in r.message
    j = r.to_json()
    assert j["status"] == "finding" and j["region_bytes"] == rows * 1152 and j["fits_max_total_num_tokens"] == fits


def test_exactly_at_the_limit_is_a_finding():
    r = check_region(meta(kv_pool_rows=DEFAULT_MR_LIMIT // 1024, kv_pool_row_bytes=1024))
    assert r.region_bytes == DEFAULT_MR_LIMIT and r.status == "finding"


def test_just_under_is_a_warning_well_under_is_ok():
    just = check_region(meta(**geometry_for(DEFAULT_MR_LIMIT - 2 * 1152)))
    assert just.status == "warning" and just.region_bytes < DEFAULT_MR_LIMIT
    near_edge = check_region(meta(**geometry_for(int(DEFAULT_MR_LIMIT * 0.951))))
    assert near_edge.status == "warning"
    below = check_region(meta(**geometry_for(int(DEFAULT_MR_LIMIT * 0.94))))
    assert below.status == "ok"
    assert check_region(meta(**geometry_for(1 << 30))).status == "ok"


def test_the_captured_env_limit_and_layers_per_buffer_count():
    g = {"kv_pool_rows": 1_000_000, "kv_pool_row_bytes": 1152}  # 1.15 GB: ok under 2 GiB
    assert check_region(meta(**g)).status == "ok"
    r = check_region(meta(**g, mori_max_mr_bytes=1 << 30))  # SGLANG_MORI_MAX_MR_BYTES=1 GiB
    assert r.status == "finding" and r.limit_bytes == 1 << 30 and r.limit_source == "SGLANG_MORI_MAX_MR_BYTES"
    r = check_region(meta(**g, kv_pool_layers_per_buffer=2))  # two layers in one registered buffer
    assert r.status == "finding" and r.region_bytes == 2 * 1_000_000 * 1152
    assert (r.fits_max_total_num_tokens + 64) * 2 * 1152 < DEFAULT_MR_LIMIT


@pytest.mark.parametrize("missing", [{}, {"kv_pool_rows": 10}, {"kv_pool_row_bytes": 1152}])
def test_missing_geometry_is_not_recorded_never_a_pass(missing):
    r = check_region(meta(**missing))
    assert r.status == "not_recorded" and not r.is_finding and r.region_bytes is None
    assert "not recorded" in r.message and "not checked" in r.message


def test_fitting_tokens_edges():
    assert fitting_tokens(1000, 10, 1) == 98  # 99 rows < 1000 bytes, minus the padded page
    assert fitting_tokens(100, 1000, 16) == 0


@pytest.mark.parametrize("key,value", [("kv_pool_rows", 0), ("kv_pool_row_bytes", -1), ("mori_max_mr_bytes", 0),
                                       ("kv_pool_size", -5), ("kv_pool_rows", "big"), ("disagg_mode", 3)])
def test_bad_geometry_is_invalid_naming_the_key(key, value):
    with pytest.raises(CaptureError, match=key):
        meta(**{key: value})


def test_inspect_reports_the_region(tmp_path, capsys):
    over = tmp_path / "over.safetensors"
    synth_capture(over, preset("kimi-k2-tp8", pool_tokens=4_000_000))
    assert main(["inspect", str(over), "--json"]) == 1  # a finding exits 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["metadata"]["ok"] and doc["region"]["status"] == "finding"
    assert doc["region"]["region_bytes"] == (4_000_000 + 1) * 1152
    clean = tmp_path / "clean.safetensors"
    synth_capture(clean, preset("kimi-k2-tp8"))
    assert main(["inspect", str(clean)]) == 0
    assert "region   ok" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------
# What the hook reads (stand-in pools with SGLang's attribute names; the real pool in test_hook.py)
# ---------------------------------------------------------------------------------------------


class _Pool:
    def __init__(self, kv_buffer, size=None, layer_num=None):
        self.kv_buffer, self.size, self.layer_num = kv_buffer, size, layer_num


def test_buffer_geometry_of_an_mla_pool_list_and_a_stacked_buffer():
    bufs = [torch.zeros(80, 1, 576, dtype=torch.bfloat16) for _ in range(3)]
    g = buffer_geometry(_Pool(bufs), bufs[0])
    assert g == {"kv_pool_rows": 80, "kv_pool_row_bytes": 1152, "kv_pool_layers_per_buffer": 1}
    stacked = torch.zeros(3, 80, 1, 576, dtype=torch.float8_e4m3fn)
    g = buffer_geometry(_Pool(stacked), stacked[0])
    assert g == {"kv_pool_rows": 80, "kv_pool_row_bytes": 576, "kv_pool_layers_per_buffer": 3}
    assert buffer_geometry(object(), bufs[1])["kv_pool_rows"] == 80  # no kv_buffer: the layer's own
    assert pool_counts(_Pool(bufs, size=64, layer_num=3)) == {"kv_pool_layers": 3, "kv_pool_size": 64}
    assert pool_counts(_Pool(bufs, size=True)) == {}


def test_disagg_meta_reads_the_env(monkeypatch):
    monkeypatch.setenv("SGLANG_MORI_MAX_MR_BYTES", "1073741824")
    assert disagg_meta()["mori_max_mr_bytes"] == 1 << 30
    monkeypatch.setenv("SGLANG_MORI_MAX_MR_BYTES", "two gigs")
    d = disagg_meta()
    assert "mori_max_mr_bytes" not in d and d["mori_max_mr_bytes_raw"] == "two gigs"
    monkeypatch.delenv("SGLANG_MORI_MAX_MR_BYTES")
    assert "mori_max_mr_bytes" not in disagg_meta()
