"""`refmla regions` (issue 29): the seed's question asked before a server starts, per buffer, against
SGLang's clamp and MORI's measured sizes; the Python API it is built on."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import refmla
from refmla.cli import main
from refmla.poolplan import buffers, geometry_from_config, model_geometry
from refmla.region_check import SMALLEST_FAILED, PlannedBuffer, plan_regions
from refmla.synthetic import preset, synth_capture

V4 = ["regions", "--model", "deepseek-v4-flash", "--tokens"]


def test_the_seeds_failing_pool_exits_1_naming_the_c4_buffers_6_gb(capsys):
    assert main([*V4, "23448064"]) == 1
    out = capsys.readouterr().out
    assert out.startswith("regions  FINDING") and "C4 KV buffer" in out and "6002704384 bytes (6.00 GB" in out
    assert "C4 KV x21: 6002704384 bytes" in out and "FAILS" in out
    assert "C4 indexer x21" in out and "C128 KV x20" in out  # every registered buffer, not only the largest


def test_the_seeds_registered_pool_exits_0_above_the_clamp(capsys):
    assert main([*V4, "8551168", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["band"] == "registers" and doc["status"] == "ok" and "registers above SGLang's clamp" in doc["message"]
    assert doc["fits_max_total_num_tokens"] == 8_388_096 and doc["limit_source"] == "default"
    c4 = doc["buffers"][0]
    assert (c4["name"], c4["count"], c4["bytes_per_token"], c4["region_bytes"]) == ("C4 KV", 21, 256, 8_551_168 * 256)
    assert {b["band"] for b in doc["buffers"][1:]} == {"under_clamp"}


def test_a_region_of_the_bytes_measured_to_fail_fails():
    r = plan_regions([PlannedBuffer("C4 KV", 256 * 256, 256)], SMALLEST_FAILED // 256)
    assert r.region_bytes == 4_294_836_224 and r.band == "fails" and r.is_finding
    below = plan_regions([PlannedBuffer("C4 KV", 256 * 256, 256)], SMALLEST_FAILED // 256 - 256)
    assert below.band == "unmeasured" and below.status == "warning"


def test_the_env_clamp_overrides_and_a_bad_one_names_the_variable(monkeypatch, capsys):
    monkeypatch.setenv("SGLANG_MORI_MAX_MR_BYTES", str(4 << 30))
    assert main([*V4, "8551168", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["band"] == "under_clamp" and doc["limit_source"] == "SGLANG_MORI_MAX_MR_BYTES"
    assert doc["fits_max_total_num_tokens"] == 16_776_704
    assert main([*V4, "8551168", "--clamp-bytes", str(1 << 30), "--json"]) == 0  # the flag wins over the env
    assert json.loads(capsys.readouterr().out)["limit_bytes"] == 1 << 30
    monkeypatch.setenv("SGLANG_MORI_MAX_MR_BYTES", "lots")
    assert main([*V4, "8551168"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "SGLANG_MORI_MAX_MR_BYTES" in err[0]


def test_another_transfer_backend_is_unmeasured_not_a_finding(capsys):
    assert main([*V4, "23448064", "--transfer-backend", "mooncake", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["band"] == "unmeasured" and "nothing is measured for mooncake" in doc["message"]


def test_a_hf_config_gives_the_presets_buffers(tmp_path, capsys):
    cfg = {"num_hidden_layers": 43, "head_dim": 512, "qk_rope_head_dim": 64, "index_head_dim": 128,
           "compress_ratios": list(model_geometry("deepseek-v4-flash").compress_ratios) + [0]}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    g = geometry_from_config(str(tmp_path / "config.json"))
    assert buffers(g) == buffers(model_geometry("deepseek-v4-flash"))
    assert buffers(g, "fp8")[0].item_bytes == 64 * 584  # V4's fp8 row: 448 + 2 x 64 + 7 + 1
    (tmp_path / "bad.json").write_text(json.dumps({**cfg, "head_dim": "512"}))
    assert main(["regions", "--config", str(tmp_path / "bad.json"), "--tokens", "1024"]) == 2
    err = capsys.readouterr().err
    assert "bad.json" in err and "'head_dim'" in err


def test_mla_presets_and_the_usage_errors(capsys):
    kimi = buffers(model_geometry("kimi-k2"))
    assert kimi == [PlannedBuffer("MLA KV", 64 * 1152, 64, 61)]
    assert buffers(model_geometry("kimi-k2"), "fp8")[0].item_bytes == 64 * 576
    v32 = buffers(model_geometry("deepseek-v3.2"), "fp8")
    assert [(b.name, b.item_bytes // 64) for b in v32] == [("KV", 656), ("indexer", 132)]
    for argv, word in ((["regions", "--model", "kimi-k2"], "--tokens"), (["regions", "--tokens", "5"], "--model"),
                       ([*V4, "0"], "--tokens")):  # fmt: skip
        assert main(argv) == 2
        assert word in capsys.readouterr().err


def test_a_captures_pool_and_the_python_api(tmp_path, capsys):
    over = tmp_path / "over.safetensors"
    synth_capture(over, preset("kimi-k2-tp8", pool_tokens=4_000_000))  # (4M + 1 page) rows x 1152 B: 4.6 GB
    assert main(["regions", str(over)]) == 1
    assert "FAILS" in capsys.readouterr().out
    check = refmla.regions(over)
    assert check.band == "fails" and check.source == "kv_buffer" and check.buffers[0].tokens == 4_000_000
    assert refmla.regions(over, clamp=8 << 30).band == "fails"  # a larger clamp does not make MORI register it
    with pytest.raises(ValueError, match="not both"):
        refmla.regions(over, model="kimi-k2", tokens=10)


def test_import_refmla_stays_light():
    code = "import sys, refmla; print('torch' in sys.modules, callable(refmla.regions), 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "True", "True"]  # nothing heavy until the API is first used


def test_the_api_names_are_plain_functions_and_no_module_is_callable():
    import inspect

    import refmla.api
    import refmla.pipeline
    import refmla.region_check
    import refmla.synthetic

    for name in ("replay", "synth", "regions"):
        f = getattr(refmla, name)
        assert inspect.isfunction(f) and f is getattr(refmla.api, name), name
    for module in (refmla.pipeline, refmla.region_check, refmla.synthetic):
        assert type(module) is type(inspect) and not callable(module), module.__name__


def test_page_size_and_kv_dtype_change_the_buffers_the_check_sees(capsys):
    from refmla.region_check import DEFAULT_MR_LIMIT, clamp_tokens

    argv = ["regions", "--model", "kimi-k2", "--tokens", "1880000", "--page-size", "1", "--tp", "8", "--json"]
    assert main([*argv, "--kv-dtype", "fp8"]) == 0
    doc = json.loads(capsys.readouterr().out)
    (b,) = doc["buffers"]
    got = (b["name"], b["count"], b["item_bytes"], b["page_size"], b["region_bytes"])
    assert got == ("MLA KV", 61, 576, 1, 1_880_000 * 576)
    assert b["clamp_tokens"] == clamp_tokens(DEFAULT_MR_LIMIT, 576, 1) == 3_728_269 and b["band"] == "under_clamp"
    assert main([*argv, "--kv-dtype", "bf16"]) == 0  # 1152 B/token: 2.166 GB, over the clamp, under 2.189 GB
    assert json.loads(capsys.readouterr().out)["buffers"][0]["band"] == "registers"
    with pytest.raises(ValueError, match="--kv-dtype 'int4'"):  # the API's check (argparse's choices on the CLI)
        refmla.regions(model="kimi-k2", tokens=10, kv_dtype="int4")
