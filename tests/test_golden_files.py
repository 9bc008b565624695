"""golden/ is exactly what ``refmla golden generate --suite quick`` writes, and matches its manifest; a golden
result survives the JSON of check_isolated's process boundary."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from pathlib import Path

import pytest
import torch

from refmla import golden
from refmla.capture import read_capture
from refmla.compare import Comparison, Worst
from refmla.results import BackendEntry, Explanation, SplitCheck
from refmla.util import json_safe

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
LIMIT = 16 * 2**20  # the quick suite lives in the repository


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.is_file()}


def _first_difference(name: str, a: bytes, b: bytes) -> str:
    if len(a) != len(b):
        return f"{name}: {len(a)} bytes in golden/, {len(b)} regenerated"
    i = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    return f"{name}: first differing byte at offset {i}"


@pytest.mark.slow
def test_regenerating_the_quick_suite_reproduces_golden_byte_for_byte(tmp_path):
    golden.generate(tmp_path, suite="quick")
    want, got = _files(GOLDEN), _files(tmp_path)
    assert sorted(want) == sorted(got), (
        "golden/ and a fresh quick suite hold different files (refmla golden generate --out golden)"
    )
    diffs = [_first_difference(n, want[n], got[n]) for n in want if want[n] != got[n]]
    assert not diffs, "golden/ is stale or generation is not deterministic:\n" + "\n".join(diffs)


def test_every_golden_file_matches_its_manifest():
    manifest = golden.load_manifest(GOLDEN)
    assert manifest["generator"] == golden.GENERATOR and manifest["suite"] == "quick"
    assert [c["name"] for c in manifest["cases"]] == list(golden.QUICK)
    assert {c["file"] for c in manifest["cases"]} == {p.name for p in GOLDEN.glob("*.safetensors")}
    for case in manifest["cases"]:
        data = (GOLDEN / case["file"]).read_bytes()
        assert hashlib.sha256(data).hexdigest() == case["sha256"], f"{case['file']}: sha256 differs from manifest.json"
        assert len(data) == case["bytes"]
        assert case["params"] == golden.QUICK[case["name"]].params(), f"{case['name']}: parameters changed, regenerate"


def test_the_quick_suite_fits_in_16_mib():
    total = sum(p.stat().st_size for p in GOLDEN.iterdir() if p.is_file())
    assert total <= LIMIT, f"golden/ holds {total / 2**20:.2f} MiB > 16 MiB"


def test_a_golden_file_is_a_capture_with_its_reference_and_poisoned_pool():
    case = golden.QUICK["kimi-h8-len255-256-257-page16"]
    cap = read_capture(GOLDEN / f"{case.name}.safetensors")
    meta = cap.meta.extra["golden"]
    assert meta["generator"] == golden.GENERATOR and meta["params"] == case.params()
    assert meta["out_dtype"] == "bfloat16" and meta["tolerance"]["k"] == 2.0
    assert cap.out.dtype == cap.lse.dtype == cap.attn_logits.dtype == torch.float32
    assert cap.kv_buffer.shape[0] == case.pool_rows
    used = torch.zeros(case.pool_rows, dtype=torch.bool)
    used[cap.kv_indices.long()] = True
    assert bool(torch.isnan(cap.kv_buffer[~used].float()).all()), "every unused row (free pages, page tails) is NaN"
    assert not bool(torch.isnan(cap.kv_buffer[used].float()).any())
    # the 257-token request ends one token into a 16-token page: its tail is poison
    last = int(cap.kv_indices[-1])
    assert last % 16 == 0 and bool(torch.isnan(cap.kv_buffer[last + 1 : last + 16].float()).all())


def test_inputs_are_counter_hashes_on_an_exact_grid():
    for dtype in (torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e4m3fnuz):
        x = golden.grid_normal(3, "q", (64, 576), dtype)
        assert x.dtype == dtype and torch.equal(
            x.view(torch.uint8), golden.grid_normal(3, "q", (64, 576), dtype).view(torch.uint8)
        )
        units = x.double() * 2**15  # on the 2**-15 grid, under 2**18 units: what keeps q . k exact in fp64
        assert torch.equal(units, units.round()) and float(units.abs().max()) < 2**18
        assert 0.9 < float(x.double().std() / 1.15) < 1.1 and abs(float(x.double().mean())) < 0.05
    assert not torch.equal(
        golden.grid_normal(3, "q", (8,), torch.bfloat16), golden.grid_normal(4, "q", (8,), torch.bfloat16)
    )
    # the splitmix64 stream itself is pinned: a change here changes every golden byte
    assert int(golden.counter_hash(0, "q", 1)[0]) == 0xDF77165263844E84


def test_logits_are_exact_in_fp64_whatever_the_summation_order():
    q = golden.grid_normal(1, "q", (8, 576), torch.bfloat16, -1).double()
    k = golden.grid_normal(1, "kv", (300, 576), torch.bfloat16).double()
    s = q @ k.T
    assert torch.equal(s, (q.flip(1) @ k.flip(1).T)), "reordered dot products must agree bit for bit"
    assert torch.equal(s, (q[:, :288] @ k[:, :288].T) + (q[:, 288:] @ k[:, 288:].T))


def test_a_case_says_its_mode_and_every_mode_has_a_builder():
    assert set(golden.MODES) == set(golden.BUILDERS)
    case = golden.QUICK["kimi-h8-len1-31-32-33"]
    assert case.mode == "decode" and golden.case_meta(case)["mode"] == "decode"
    # a field added after the committed goldens stays out of params() at its default: their bytes hold
    assert all(k not in case.params() for k in golden.cases.ADDED_FIELDS)
    with pytest.raises(ValueError, match="mode"):
        golden.GoldenCase("x", "y", seq_lens=(1,), mode="no-such-mode")


def _result_with_everything() -> golden.GoldenResult:
    """A failing result whose entry holds a comparison, a split check and an explanation."""
    ok = golden.check(GOLDEN / "kimi-h8-len1-31-32-33.safetensors", "reference")
    cmp = dataclasses.replace(ok.entry.comparison, name="triton", passed=False, reasons=["row 3 too far"],
                              cos_diff=math.nan)  # fmt: skip
    entry = BackendEntry.judged(cmp, info={"kernel_seconds": 0.5})
    entry.splits = SplitCheck("fail", reason="split 2 of request 3", compared_splits=7, worst=Worst.of(split=2))
    entry.explanation = Explanation("seq_len_off_by", 3, {"delta": -1}, 1e-7, heads=[0, 7], extra={"scope": "x"})
    entry.seconds = 1.25
    return golden.GoldenResult(ok.case, "triton", entry, ok.why, "refmla replay f --backend triton", 2.5)


def test_a_golden_result_crosses_the_process_boundary_as_json():
    r = _result_with_everything()
    sent = json.loads(json.dumps(json_safe(r.to_json())))  # what `python -m refmla.golden check` prints
    back = golden.GoldenResult.from_json(sent)
    assert isinstance(back.entry, BackendEntry) and isinstance(back.entry.comparison, Comparison)
    assert isinstance(back.entry.splits, SplitCheck) and isinstance(back.entry.explanation, Explanation)
    assert json_safe(back.to_json()) == sent and back.message() == r.message()
    assert math.isnan(back.entry.comparison.cos_diff), "a NaN spelled null comes back as NaN"
    assert (back.status, back.reason, back.passed) == ("fail", "row 3 too far", False)
    lines = r.message().splitlines()
    assert lines[0].startswith("golden kimi-h8-len1-31-32-33 / triton: FAIL  [")
    assert lines[1:] == [
        "  row 3 too far",
        lines[2],  # the worst element, checked below
        "  splits: fail (split 2 of request 3)",
        "  explained by seq_len_off_by(delta=-1) request 3",
        "  replay: refmla replay f --backend triton",
    ]
    assert lines[2].startswith("  worst element: request ") and " triton " in lines[2] and " vs reference " in lines[2]


@pytest.mark.slow
def test_check_isolated_returns_the_typed_result_of_the_child():
    path = GOLDEN / "kimi-h8-len1-31-32-33.safetensors"
    r = golden.check_isolated(path, "reference")
    assert r.passed, r.message()
    assert r.case == "kimi-h8-len1-31-32-33" and isinstance(r.entry.comparison, Comparison)
    here = golden.check(path, "reference")
    assert r.entry.info == here.entry.info and r.entry.worst == here.entry.worst and r.replay == here.replay
