"""`refmla inspect` checks FlashMLA's recorded tile-scheduler plan without running it (issue 31).

The plans here are made by the test's own port of FlashMLA's scheduler loop
(``csrc/smxx/decode/get_decoding_sched_meta``: blocks of 64 tokens, a fixed overhead of 5 blocks
per request, payload ceil(total / parts) + 5), written out in both row layouts FlashMLA has had
(the tensor API's ``block`` rows and the 2026 ``DecodingSchedMeta`` ``struct`` rows). A correct plan
is clean on any batch; a part moved one block back (a range done twice), a part cut short (a range
done by none), a previous batch's part, num_splits off by one and a split piece flagged whole are
each named; the SGLang hook records the plan its FlashMLA decode read.
"""

from __future__ import annotations

import json
import random
import sys

import pytest
import torch

from helpers import raw_write
from hostile import run_cli
from refmla.capture import read_capture, write_capture
from refmla.flashmla_plan import check_flashmla_plan
from refmla.synthetic import SynthSpec, make_inputs, make_meta

BLOCK, OVERHEAD = 64, 5


def schedule(lengths: list[int], parts: int, layout: str) -> tuple[list[list[int]], list[int]]:
    """FlashMLA's plan for ``lengths`` over ``parts`` SM parts: (rows [parts, 8], num_splits [B + 1])."""
    B = len(lengths)
    nb = [max(1, -(-L // BLOCK)) for L in lengths]
    last = [max(L - 1, 0) // BLOCK for L in lengths]
    payload = -(-sum(n + OVERHEAD for n in nb) // parts) + OVERHEAD
    req = blk = split = cum = 0
    cums, rows = [0] * (B + 1), []
    for _ in range(parts):
        begin_req, begin_block, begin_split, first = req, blk, split, int(blk != 0)
        remain = payload
        while req < B:
            if remain >= nb[req] - blk + OVERHEAD:  # the rest of this request fits
                cum += split + 1
                cums[req + 1] = cum
                remain -= nb[req] - blk + OVERHEAD
                req, blk, split = req + 1, 0, 0
            else:
                if remain - OVERHEAD > 0:
                    blk, split = blk + remain - OVERHEAD, split + 1
                break
        end_req = req if blk > 0 else req - 1
        end_block = blk if blk > 0 else (0 if lengths[req - 1] == 0 else last[req - 1] + 1)
        last_split = int(end_block != last[end_req] + 1 and lengths[end_req] != 0)
        if begin_req == end_req:
            first = last_split = int(first or last_split)
        rows.append([begin_req, begin_block, end_req, end_block, begin_split, 0, 0, 0] if layout == "block" else
                    [begin_req, end_req, begin_block, end_block, begin_split, first, last_split, 0])  # fmt: skip
    assert req == B and blk == 0 and split == 0
    return rows, cums


def check(rows, cums, lengths, layout):
    return check_flashmla_plan(torch.tensor(rows, dtype=torch.int32), torch.tensor(cums, dtype=torch.int32),
                               lengths, layout)  # fmt: skip


# request 1 (1,300 tokens: 21 blocks) is split over several parts at 16 parts
LENGTHS = [70, 1300, 0, 64, 65, 1]
COLS = {"block": {"begin_req": 0, "begin_block": 1, "end_req": 2, "end_block": 3},
        "struct": {"begin_req": 0, "end_req": 1, "begin_block": 2, "end_block": 3}}  # fmt: skip


@pytest.mark.parametrize("layout", ["block", "struct"])
def test_every_correct_plan_is_clean(layout):
    rng = random.Random(7)
    for _ in range(400):
        lengths = [rng.choice([0, 1, 63, 64, 65, rng.randint(0, 3000)]) for _ in range(rng.randint(1, 12))]
        parts = rng.choice([1, 2, 3, 8, 16, 33, 132])
        rows, cums = schedule(lengths, parts, layout)
        found = check(rows, cums, lengths, layout)
        assert found.ok, (lengths, parts, [v.message for v in found.violations])


def _split_part(rows, layout, request=1):
    """The index of a part that begins inside ``request`` (its begin block > 0)."""
    c = COLS[layout]
    return next(i for i, r in enumerate(rows) if r[c["begin_req"]] == request and r[c["begin_block"]] > 0)


@pytest.mark.parametrize("layout", ["block", "struct"])
def test_a_part_moved_one_block_back_does_that_block_twice(layout):
    rows, cums = schedule(LENGTHS, 16, layout)
    p = _split_part(rows, layout)
    rows[p][COLS[layout]["begin_block"]] -= 1
    found = check(rows, cums, LENGTHS, layout)
    first = found.first
    assert first.kind == "kv_range_repeated" and first.detail["request"] == 1, found.to_json()
    start = rows[p][COLS[layout]["begin_block"]]
    assert first.detail["blocks"] == [start, start + 1] and first.detail["positions"] == [64 * start, 64 * start + 64]
    assert first.detail["parts"] == [p - 1, p]


@pytest.mark.parametrize("layout", ["block", "struct"])
def test_a_part_cut_short_leaves_blocks_undone(layout):
    rows, cums = schedule(LENGTHS, 16, layout)
    p = _split_part(rows, layout) - 1  # the part before ends where p begins: end one block early
    rows[p][COLS[layout]["end_block"]] -= 1
    found = check(rows, cums, LENGTHS, layout)
    end = rows[p][COLS[layout]["end_block"]]
    assert [v.kind for v in found.violations] == ["kv_range_uncovered"], found.to_json()
    assert found.first.detail == {"request": 1, "blocks": [end, end + 1], "positions": [64 * end, 64 * end + 64]}


@pytest.mark.parametrize("layout", ["block", "struct"])
def test_a_previous_batchs_part_is_stale(layout):
    rows, cums = schedule(LENGTHS, 16, layout)
    c = COLS[layout]
    stale = [0] * 8
    stale[c["begin_req"]], stale[c["end_req"]], stale[c["end_block"]] = 7, 7, 3  # request 7 of a batch of 6
    rows[-1] = stale
    found = check(rows, cums, LENGTHS, layout)
    assert found.first.kind == "work_list_stale" and found.first.detail["part"] == len(rows) - 1, found.to_json()


def test_a_plan_for_shorter_lengths_leaves_the_new_blocks_undone():
    """The plan of the previous step (request 1 one block shorter) replayed on this step's lengths."""
    before = list(LENGTHS)
    before[1] -= 64
    rows, cums = schedule(before, 16, "struct")
    found = check(rows, cums, LENGTHS, "struct")
    uncovered = [v for v in found.violations if v.kind == "kv_range_uncovered"]
    assert uncovered and uncovered[0].detail["request"] == 1 and uncovered[0].detail["blocks"] == [20, 21]


def test_num_splits_off_by_one_misaddresses_the_partials():
    rows, cums = schedule(LENGTHS, 16, "block")
    n = cums[2] - cums[1]
    assert n > 2
    cums = cums[:2] + [x - 1 for x in cums[2:]]  # request 1 now has n - 1 splits: its last one's row is request 2's
    found = check(rows, cums, LENGTHS, "block")
    bad = [v for v in found.violations if v.kind == "partials_misaddressed"]
    assert bad and bad[0].detail["request"] == 1 and bad[0].detail["split"] == n - 1, found.to_json()


def test_a_split_piece_flagged_whole_writes_the_output_directly():
    rows, cums = schedule(LENGTHS, 16, "struct")
    p = _split_part(rows, "struct")
    rows[p][5] = rows[p][6] = 0  # flags: request 1's piece is not split (written straight to the output)
    found = check(rows, cums, LENGTHS, "struct")
    assert found.first.kind == "partials_misaddressed" and found.first.detail["part"] == p, found.to_json()
    assert "straight to the output" in found.first.message


def test_garbage_is_a_finding_not_a_crash():
    found = check_flashmla_plan(torch.tensor([[1 << 30] * 8], dtype=torch.int32), torch.tensor([0, 5, 2], dtype=torch.int32),
                                [10, 10], "struct")  # fmt: skip
    assert not found.ok and found.first.kind in ("work_list_stale", "partials_misaddressed")
    unreadable = check_flashmla_plan(torch.zeros(2, 8, dtype=torch.int32), torch.zeros(3, dtype=torch.int32), [1, 1], "tokens")
    assert unreadable.first.kind == "plan_unreadable"


# --- refmla inspect on a capture -------------------------------------------------------------

SPEC = SynthSpec(name="flashmla-plan", num_heads=8, seq_lens=(70, 1300, 1, 64), max_kv_splits=8)


def write_with_plan(path, rows, cums, layout="block"):
    t = make_inputs(SPEC)
    t["flashmla_tile_scheduler_metadata"] = torch.tensor(rows, dtype=torch.int32)
    t["flashmla_num_splits"] = torch.tensor(cums, dtype=torch.int32)
    meta = {**make_meta(SPEC), "flashmla_sched_layout": layout}
    write_capture(path, t, meta, compact=False)
    return str(path)


def test_inspect_names_the_first_violation_and_a_correct_plan_is_clean(tmp_path):
    rows, cums = schedule(list(SPEC.seq_lens), 8, "block")
    code, out, _ = run_cli("inspect", write_with_plan(tmp_path / "ok.safetensors", rows, cums), "--json")
    plan = json.loads(out)["plan"]
    assert code == 0 and plan["ok"] and plan["unit"] == "SM parts" and plan["work_items"] == 8, plan
    p = _split_part(rows, "block")
    rows[p][1] -= 1
    path = write_with_plan(tmp_path / "bad.safetensors", rows, cums)
    code, out, _ = run_cli("inspect", path, "--json")
    assert code == 1 and json.loads(out)["plan"]["first"]["kind"] == "kv_range_repeated"
    text = run_cli("inspect", path)[1]
    assert "plan     VIOLATIONS: FlashMLA tile-scheduler metadata, 8 SM parts; first: kv_range_repeated" in text


@pytest.mark.parametrize("drop,key", [("flashmla_num_splits", "flashmla_num_splits"), (None, "flashmla_sched_layout")])
def test_half_a_plan_or_no_layout_is_refused_naming_it(tmp_path, drop, key):
    rows, cums = schedule(list(SPEC.seq_lens), 8, "block")
    t = make_inputs(SPEC)
    t["flashmla_tile_scheduler_metadata"] = torch.tensor(rows, dtype=torch.int32)
    t["flashmla_num_splits"] = torch.tensor(cums, dtype=torch.int32)
    if drop:
        del t[drop]
    meta = {**make_meta(SPEC), **({"flashmla_sched_layout": "block"} if drop else {})}
    path = str(tmp_path / "half.safetensors")
    raw_write(path, t, meta)
    code, _, err = run_cli("inspect", path)
    assert code == 2 and key in err and path in err and "Traceback" not in err


# --- the SGLang hook records the plan --------------------------------------------------------


@pytest.mark.parametrize("layout", ["block", "struct"])
def test_the_hook_records_the_plan_flashmlas_decode_read(tmp_path, monkeypatch, layout):
    from types import SimpleNamespace

    from test_hook_nvidia import NvCase, build, standin  # noqa: F401  (the fixture, by name)

    from helpers import STANDINS
    from refmla.hook import patching
    from refmla.hook.config import HookConfig

    monkeypatch.syspath_prepend(str(STANDINS))
    import sglang_nvidia

    for name, mod in sglang_nvidia.modules().items():
        monkeypatch.setitem(sys.modules, name, mod)
    case = NvCase("flashmla", 64)
    try:
        patching.install(HookConfig(out_dir=str(tmp_path), min_seq_len=1, backends=frozenset({"flashmla"})))
        obj, kwargs, _ = build(case, sglang_nvidia)
        rows, cums = schedule(list(case.seq_lens), 4, layout)
        sched, num = torch.tensor(rows, dtype=torch.int32), torch.tensor(cums, dtype=torch.int32)
        if layout == "block":  # SGLang's legacy tensors
            obj.forward_metadata.flashmla_metadata, obj.forward_metadata.num_splits = sched, num
        else:  # a FlashMLASchedMeta its first decode filled
            obj.forward_metadata.flashmla_metadata = SimpleNamespace(tile_scheduler_metadata=sched, num_splits=num,
                                                                     have_initialized=True)  # fmt: skip
        obj.forward_decode(**kwargs)
        assert patching.current_state().summary()["files_written"] == 1
    finally:
        patching.uninstall()
    path = next(tmp_path.glob("*.safetensors"))
    cap = read_capture(path)
    assert cap.meta.extra["flashmla_sched_layout"] == layout
    assert torch.equal(cap.flashmla_tile_scheduler_metadata, sched) and torch.equal(cap.flashmla_num_splits, num)
    code, out, _ = run_cli("inspect", str(path), "--json")
    assert code == 0 and json.loads(out)["plan"]["ok"]
