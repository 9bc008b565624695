"""The MR region-size check (refmla.region_check) and the pool geometry the hook records (refmla.hook.geometry)."""

from __future__ import annotations

import json

import pytest
import torch

from refmla.capture import CaptureError, parse_meta
from refmla.cli import main
from refmla.hook.geometry import buffer_geometry, disagg_meta, pool_counts
from refmla.region_check import (DEFAULT_MR_LIMIT, LARGEST_REGISTERED, MEASURED, SMALLEST_FAILED, check_region,
                            clamp_tokens, fitting_tokens, size_text)
from refmla.synthetic import preset, synth_capture

BASE = {"mode": "decode", "backend": "triton", "kv_lora_rank": 512, "qk_rope_head_dim": 64,
        "sm_scale": 0.1, "logit_cap": 0.0, "page_size": 64}  # fmt: skip


def meta(**geometry):
    return parse_meta({**BASE, **geometry})


def geometry_for(region_bytes: int, row_bytes: int = 1152, page: int = 64) -> dict:
    """Geometry whose region is the largest row multiple not above ``region_bytes``."""
    rows = region_bytes // row_bytes
    return {"kv_pool_rows": rows, "kv_pool_row_bytes": row_bytes, "kv_pool_layers_per_buffer": 1,
            "kv_pool_size": rows - page}  # fmt: skip


def test_past_the_smallest_measured_failure_is_a_finding_with_the_numbers():
    rows = 4_000_000  # Kimi-K2 bf16 rows of 1152 bytes: 4.61 GB, past the 4294836224 bytes measured to fail
    r = check_region(meta(kv_pool_rows=rows, kv_pool_row_bytes=1152, kv_pool_layers_per_buffer=1, kv_pool_size=rows - 64))
    assert r.status == "finding" and r.is_finding and r.band == "fails"
    assert r.region_bytes == rows * 1152 and r.limit_bytes == DEFAULT_MR_LIMIT and r.limit_source == "default"
    fits = r.fits_max_total_num_tokens
    assert fits % 64 == 0 and (fits + 64) * 1152 < DEFAULT_MR_LIMIT <= (fits + 128) * 1152  # SGLang's clamp
    assert str(rows * 1152) in r.message and str(fits) in r.message and "4294836224" in r.message
    j = r.to_json()
    assert j["status"] == "finding" and j["band"] == "fails" and j["fits_max_total_num_tokens"] == fits
    assert j["smallest_failed_bytes"] == SMALLEST_FAILED and j["largest_registered_bytes"] == LARGEST_REGISTERED


def test_at_the_clamp_is_not_a_finding_the_clamp_is_not_moris_limit():
    r = check_region(meta(kv_pool_rows=DEFAULT_MR_LIMIT // 1024, kv_pool_row_bytes=1024))
    assert r.region_bytes == DEFAULT_MR_LIMIT and r.status == "ok" and r.band == "registers"
    assert "registers above SGLang's clamp" in r.message


def test_the_bands_in_order_of_size():
    assert check_region(meta(**geometry_for(1 << 30))).band == "under_clamp"
    assert check_region(meta(**geometry_for(DEFAULT_MR_LIMIT + 2 * 1152))).band == "registers"
    mid = check_region(meta(**geometry_for(3 << 30)))
    assert mid.band == "unmeasured" and mid.status == "warning" and "unmeasured" in mid.message
    assert check_region(meta(**geometry_for(SMALLEST_FAILED + 1152))).band == "fails"


def test_the_captured_env_clamp_and_layers_per_buffer_count():
    g = {"kv_pool_rows": 1_000_000, "kv_pool_row_bytes": 1152, "kv_pool_size": 1_000_000 - 64}  # 1.15 GB
    assert check_region(meta(**g)).band == "under_clamp"
    r = check_region(meta(**g, mori_max_mr_bytes=1 << 30))  # SGLANG_MORI_MAX_MR_BYTES=1 GiB: over it, still registers
    assert r.band == "registers" and r.limit_bytes == 1 << 30 and r.limit_source == "SGLANG_MORI_MAX_MR_BYTES"
    assert (r.fits_max_total_num_tokens + 64) * 1152 < 1 << 30
    r = check_region(meta(**g, kv_pool_layers_per_buffer=4))  # four layers in one registered buffer: 4.6 GB
    assert r.status == "finding" and r.region_bytes == 4 * 1_000_000 * 1152
    assert (r.fits_max_total_num_tokens + 64) * 4 * 1152 < DEFAULT_MR_LIMIT


@pytest.mark.parametrize("missing", [{}, {"kv_pool_rows": 10}, {"kv_pool_row_bytes": 1152}])
def test_missing_geometry_is_not_recorded_never_a_pass(missing):
    r = check_region(meta(**missing))
    assert r.status == "not_recorded" and not r.is_finding and r.region_bytes is None
    assert "not recorded" in r.message and "not checked" in r.message


def test_fitting_tokens_edges():
    assert fitting_tokens(1000, 10, 1) == 98  # 99 rows < 1000 bytes, minus the padded page
    assert fitting_tokens(100, 1000, 16) == 0


def test_one_clamp_formula_reproduces_the_region_measured_to_fail():
    """A 4 GiB clamp gives 16776704 tokens: x 256 B that is the 4294836224-byte region that failed."""
    assert clamp_tokens(4 << 30, 256 * 256, 256) == 16_776_704 and 16_776_704 * 256 == SMALLEST_FAILED
    assert clamp_tokens(DEFAULT_MR_LIMIT, 256 * 256, 256) == 8_388_096  # the 2 GiB default's cap (README, contract)
    assert all(m.region_bytes > 0 for m in MEASURED) and LARGEST_REGISTERED < SMALLEST_FAILED


def test_the_docs_print_the_one_table_and_the_one_formulas_caps():
    """docs/contract.md section 8 holds MEASURED row for row; it and the README print clamp_tokens' caps."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    contract, readme = ((root / name).read_text() for name in ("docs/contract.md", "README.md"))
    table = contract[contract.index("## 8. The MR region-size check"):]
    rows = [ln for ln in table.splitlines() if ln.startswith("| ") and ("registered" in ln or "failed" in ln)]
    assert [(r.split("|")[1].split()[0], "registered" in r.split("|")[2]) for r in rows] == \
        [(f"{m.region_bytes:,}", m.registered) for m in MEASURED]  # fmt: skip
    caps = [f"{clamp_tokens(clamp, 256 * 256, 256):,}" for clamp in (DEFAULT_MR_LIMIT, 4 << 30)]
    for doc in (table, readme):
        assert all(cap in doc for cap in caps) and "8,388,352" not in doc  # one formula; not the page-off one
    assert f"{LARGEST_REGISTERED:,}" in readme and f"{SMALLEST_FAILED:,}" in readme


def test_sizes_never_read_as_equal_to_the_limit():
    over = size_text(DEFAULT_MR_LIMIT + 28672, DEFAULT_MR_LIMIT)  # 2147512320 bytes, the example
    assert "2.00000 GiB" not in over and "2.00003 GiB" in over
    assert "4.000 GiB" not in size_text(SMALLEST_FAILED) and "3.9999 GiB" in size_text(SMALLEST_FAILED)


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
