"""What a user sees stays what it was: reports kept as fixtures, compared key by key.

Each scenario runs one CLI command on captures built here (deterministic: synth presets and a
seeded diff-kv pair) and compares its JSON with ``tests/fixtures/reports/<name>.json``: every key
of the fixture must be there with the same value (numbers to a relative 1e-6); keys the fixture
lacks are allowed, because the contract only ever adds keys. Timings are not compared.

When a change is *meant* to alter a report, regenerate the fixtures and say so in the commit:

    REFMLA_REGEN_FIXTURES=1 python -m pytest tests/test_fixed_reports.py
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch

from refmla.capture import write_capture
from refmla.cli import main
from refmla.synthetic import preset, synth_capture

FIXTURES = Path(__file__).parent / "fixtures" / "reports"
REGEN = bool(os.environ.get("REFMLA_REGEN_FIXTURES"))
TIMING_KEYS = {"seconds", "kernel_seconds"}
REL = 1e-6
# Cosine differences sum every element's error. The synthetic ``out``, the control, triton and
# extend are computed through fp32 GEMMs whose summation order is the CPU's BLAS kernel's (SIMD
# width): on another CPU a few of the bf16 outputs can round one ulp the other way. The worst
# element (max_abs_err, ratios) is unmoved at 1e-6; the sum moves by ~1e-4 relative (4.4e-5 measured
# between the machine that wrote the fixtures and a fresh one). A behaviour change moves it by
# orders of magnitude more.
AGGREGATE_KEYS = {"cos_diff": 1e-3, "worst_row_cos_diff": 1e-3}

# (name, preset, fault, backends): replay --json of one synthetic capture
REPLAYS = [
    ("clean-kimi", "kimi-k2-tp8", "none", ["reference"]),
    ("clean-hostile", "hostile", "none", ["reference"]),
    ("clean-extend", "kimi-k2-tp8-extend", "none", ["reference"]),
    ("seq-len-off-by", "kimi-k2-tp8", "seq_len_off_by", ["reference"]),
    ("kv-range-missing", "kimi-k2-tp8", "kv_range_missing", ["reference"]),
    ("kv-range-zero-page256", "kimi-k2-tp8-page256", "kv_range_zero", ["reference"]),
    ("split-missing", "kimi-k2-tp8", "split_missing", ["reference"]),
    ("wrong-sm-scale", "deepseek-v3-tp8", "wrong_sm_scale", ["reference"]),
    ("head-misaligned", "kimi-k2-tp8", "head_misaligned", ["reference"]),
    ("logit-cap-mismatch", "hostile", "logit_cap_mismatch", ["reference"]),
    ("extend-seq-len", "kimi-k2-tp8-extend", "seq_len_off_by", ["reference"]),
    ("demo-triton-extend", "hostile", "kv_range_zero", ["triton", "extend"]),
]


def run_json(capsys, argv: list[str]) -> tuple[int, object]:
    code = main(argv)
    out = capsys.readouterr().out
    return code, json.loads(out)


def same(expected, actual, where: str = "$", rel: float = REL) -> list[str]:
    """Every key / item of ``expected`` in ``actual`` with the same value; the differences found."""
    if isinstance(expected, dict):
        if not isinstance(actual, dict):
            return [f"{where}: expected an object, got {type(actual).__name__}"]
        diffs = []
        for k, v in expected.items():
            if k in TIMING_KEYS:
                continue
            if k not in actual:
                diffs.append(f"{where}.{k}: missing")
            else:
                diffs += same(v, actual[k], f"{where}.{k}", AGGREGATE_KEYS.get(k, REL))
        return diffs
    if isinstance(expected, list):
        if not isinstance(actual, list) or len(actual) != len(expected):
            return [f"{where}: expected a list of {len(expected)}, got {actual!r:.200}"]
        return [d for i, (e, a) in enumerate(zip(expected, actual)) for d in same(e, a, f"{where}[{i}]", rel)]
    if isinstance(expected, float) and isinstance(actual, (int, float)) and not isinstance(actual, bool):
        if math.isclose(expected, actual, rel_tol=rel, abs_tol=1e-12):
            return []
        return [f"{where}: {actual!r} != {expected!r}"]
    return [] if expected == actual else [f"{where}: {actual!r:.300} != {expected!r:.300}"]


def check(name: str, code: int, report) -> None:
    path = FIXTURES / f"{name}.json"
    doc = {"exit_code": code, "report": report}
    if REGEN:
        FIXTURES.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
        return
    expected = json.loads(path.read_text())
    diffs = same(expected, doc)
    assert not diffs, f"{name}: {len(diffs)} difference(s) from {path.name}:\n  " + "\n  ".join(diffs[:20])


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    """Run in tmp_path so the reports name relative, machine-independent paths."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize("name,preset_name,fault,backends", REPLAYS, ids=[r[0] for r in REPLAYS])
def test_replay_report_is_unchanged(in_tmp, capsys, name, preset_name, fault, backends):
    synth_capture(f"{name}.safetensors", preset(preset_name), fault)
    argv = ["replay", f"{name}.safetensors", "--json"] + [a for b in backends for a in ("--backend", b)]
    check(f"replay-{name}", *run_json(capsys, argv))


def test_replay_of_a_folder_is_unchanged(in_tmp, capsys):
    Path("caps").mkdir()
    synth_capture("caps/a.safetensors", preset("hostile"), "none")
    synth_capture("caps/b.safetensors", preset("hostile"), "wrong_sm_scale")
    Path("caps/c.safetensors").write_bytes(b"garbage")
    check("replay-folder", *run_json(capsys, ["replay", "caps", "--json", "--backend", "reference"]))


def test_inspect_report_is_unchanged(in_tmp, capsys):
    synth_capture("zero.safetensors", preset("kimi-k2-tp8"), "kv_range_zero")
    check("inspect-kv-range-zero", *run_json(capsys, ["inspect", "zero.safetensors", "--json"]))
    synth_capture("clean.safetensors", preset("hostile"), "none")
    check("inspect-clean", *run_json(capsys, ["inspect", "clean.safetensors", "--json"]))


# --------------------------------------------------------------------------------------------
# diff-kv: a prefill capture and a decode capture of the same requests at other slots
# --------------------------------------------------------------------------------------------

DV, DR, P = 32, 8, 16
LENS = (70, 33, 128)


def write_side(path: str, rows: list, seed: int, new: bool, order: tuple, mutate=None) -> None:
    """One node's capture: request b of ``order`` holds rows[b] at shuffled pages of its own pool."""
    g = torch.Generator().manual_seed(seed)
    D = DV + DR
    lens = [rows[b].shape[0] for b in order]
    pages_per = [-(-L // P) for L in lens]
    perm = torch.randperm(sum(pages_per) + 3, generator=g) + 1  # page 0 unused
    pool = torch.full(((len(perm) + 1) * P, 1, D), math.nan).to(torch.bfloat16)
    slots, used = [], 0
    for b, n in zip(order, pages_per):
        s = (perm[used : used + n, None] * P + torch.arange(P)).reshape(-1)[: rows[b].shape[0]]
        used += n
        pool[s, 0] = rows[b]
        slots.append(s)
    if mutate is not None:
        mutate(pool, slots)
    B = len(order)
    indptr = torch.zeros(B + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(torch.tensor(lens), 0)
    t = {"kv_buffer": pool, "kv_indptr": indptr, "kv_indices": torch.cat(slots).int(),
         "seq_lens": torch.tensor(lens, dtype=torch.int32)}  # fmt: skip
    if new:
        t["qo_indptr"] = indptr.clone()
        t["q"] = torch.randn(sum(lens), 1, D, generator=g).to(torch.bfloat16)
    else:
        t["q"] = torch.randn(B, 1, D, generator=g).to(torch.bfloat16)
    meta = {"mode": "extend" if new else "decode", "backend": "unknown", "kv_lora_rank": DV,
            "qk_rope_head_dim": DR, "sm_scale": 0.1, "logit_cap": 0.0, "page_size": P,
            "rids": [f"req-{b}" for b in order]}  # fmt: skip
    write_capture(path, t, meta)


def test_diff_kv_report_is_unchanged(in_tmp, capsys):
    g = torch.Generator().manual_seed(1)
    rows = [torch.randn(L + 5, DV + DR, generator=g).to(torch.bfloat16) for L in LENS]
    write_side("prefill.safetensors", [r[:L] for r, L in zip(rows, LENS)], 10, True, (0, 1, 2))
    write_side("decode.safetensors", rows, 20, False, (2, 0, 1))
    check("diff-kv-match", *run_json(capsys, ["diff-kv", "prefill.safetensors", "decode.safetensors", "--json"]))

    def lose_a_page_and_shift_another(pool, slots):
        pool[slots[0][48:64]] = 0  # req-2, page 3: not landed
        pool[slots[1][16:32]] = pool[slots[1][17:33]].clone()  # req-0, page 1: one position off

    write_side("decode-bad.safetensors", rows, 20, False, (2, 0, 1), lose_a_page_and_shift_another)
    argv = ["diff-kv", "prefill.safetensors", "decode-bad.safetensors", "--json"]
    check("diff-kv-mismatch", *run_json(capsys, argv))
