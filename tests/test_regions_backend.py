"""The region check compares a region only with figures measured for its transfer backend (the table
is MORI's): mooncake / nixl regions are unmeasured with no MORI figure in their sentences, and the
JSON names SGLang's clamp as what it is (``sglang_clamp_bytes``), never MORI's limit."""

from __future__ import annotations

import json

import pytest

from refmla.capture import parse_meta
from refmla.cli import main
from refmla.region_check import LARGEST_REGISTERED, SMALLEST_FAILED, check_region
from refmla.synthetic import make_meta, preset

# MORI's figures and the comparisons with them (the regions' own sentences before: "above the largest
# region measured to register (2189099008 bytes) and below the smallest measured to fail ...")
FIGURES = (f"{LARGEST_REGISTERED}", f"{SMALLEST_FAILED}", "above the largest", "below the smallest",
           "past the smallest", "between the largest registered and the smallest failed")  # fmt: skip


@pytest.mark.parametrize("backend", ["mooncake", "nixl"])
@pytest.mark.parametrize("tokens", ["23448064", "1000"])  # past MORI's measured failure; a tiny pool
def test_regions_of_another_backend_name_no_mori_figure(capsys, backend, tokens):
    model = "deepseek-v4-flash" if tokens != "1000" else "kimi-k2"
    assert main(["regions", "--model", model, "--tokens", tokens, "--transfer-backend", backend]) == 0
    out = capsys.readouterr().out
    assert f"nothing is measured for {backend}" in out
    assert not [f for f in FIGURES if f in out], out
    assert main(["regions", "--model", model, "--tokens", tokens, "--transfer-backend", backend, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["band"] == "unmeasured" and doc["measured_applies"] is False
    assert doc["sglang_clamp_bytes"] == doc["limit_bytes"] == doc["clamp_bytes"] == 2 << 30
    assert doc["measured_transfer_backend"] == "mori"


def test_mori_keeps_its_figures(capsys):
    assert main(["regions", "--model", "deepseek-v4-flash", "--tokens", "23448064", "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["band"] == "fails" and doc["measured_applies"] is True and f"{SMALLEST_FAILED}" in doc["message"]


def test_a_capture_of_a_mooncake_server_is_not_judged_by_mori_figures():
    """A disaggregated node's capture names its transfer backend: a 6 GB region on mooncake is
    unmeasured, not a MORI registration failure; with no backend recorded, or on a server without
    disaggregation (SGLang's server args name mooncake by default even then: nothing registered),
    MORI's figures apply (the check is MORI's)."""
    rows = 23_448_064 // 4  # a 6 GB region of 256-byte rows
    geometry = {"kv_pool_rows": rows, "kv_pool_row_bytes": 1024, "kv_pool_layers_per_buffer": 1, "kv_pool_size": rows - 64}
    base = {**make_meta(preset("kimi-k2-tp8")), **geometry}
    mooncake = check_region(parse_meta({**base, "disagg_mode": "decode", "disagg_transfer_backend": "mooncake"}))
    assert mooncake.band == "unmeasured" and not [f for f in FIGURES if f in mooncake.message]
    assert check_region(parse_meta({**base, "disagg_mode": "decode", "disagg_transfer_backend": "mori"})).band == "fails"
    assert check_region(parse_meta(base)).band == "fails"
    for mode in ({}, {"disagg_mode": "null"}):  # no disaggregation: the default name registered nothing
        assert check_region(parse_meta({**base, **mode, "disagg_transfer_backend": "mooncake"})).band == "fails"
