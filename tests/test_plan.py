"""`refmla inspect` checks a kernel's recorded launch plan without running it (issue 31): an
aiter-style persistent work list, built here by the test's own code the way aiter lays it out
(work_info_set rows: batch_idx, partial_loc, qo_start, qo_end, kv_start, kv_end, kv_offset,
head_start | head_end << 16; reduce maps per request tile), with one item misrouted and one KV
range repeated: inspect names both, the first one first; the correct plan is clean."""

from __future__ import annotations

import json

import pytest
import torch

from hostile import run_cli
from refmla.capture import write_capture
from refmla.synthetic import SynthSpec, make_inputs, make_meta

SPEC = SynthSpec(name="plan", num_heads=8, seq_lens=(70, 33, 120, 16), max_kv_splits=8)
GRANULARITY, HEADS, CUS = 16, 16, 8  # kv entries per work item, the kernel's (padded) heads, CUs


def aiter_plan(kv_indptr: torch.Tensor) -> dict[str, list]:
    """The plan as lists: one work item per GRANULARITY entries of each request, partials for a
    request done by more than one item, one reduce tile per request (its final row: the request's)."""
    kv = kv_indptr.tolist()
    works, reduce_indptr, final, partial = [], [0], [], []
    for b in range(len(kv) - 1):
        chunks = [(s, min(s + GRANULARITY, kv[b + 1])) for s in range(kv[b], kv[b + 1], GRANULARITY)]
        for s, e in chunks:
            loc = len(partial) if len(chunks) > 1 else -1
            if loc >= 0:
                partial.append(loc)
            works.append([b, loc, b, b + 1, s, e, kv[b + 1] - e, HEADS << 16])
        reduce_indptr.append(len(partial))
        final.append([b, b + 1])
    per = -(-len(works) // CUS)
    return {"works": works, "work_indptr": [min(c * per, len(works)) for c in range(CUS + 1)],
            "reduce_indptr": reduce_indptr, "final": final, "partial": partial}  # fmt: skip


def write_with_plan(path, plan: dict) -> str:
    t = make_inputs(SPEC)
    t["out"] = torch.zeros(len(SPEC.seq_lens), SPEC.num_heads, SPEC.kv_lora_rank, dtype=SPEC.dtype)
    i32 = dict(dtype=torch.int32)
    spare = [[-1] * 8] * 3  # the buffer's tail past work_indptr[-1]: whatever torch.empty held
    t["aiter_work_info_set"] = torch.tensor(plan["works"] + spare, **i32)
    t["aiter_work_indptr"] = torch.tensor(plan["work_indptr"], **i32)
    t["aiter_reduce_indptr"] = torch.tensor(plan["reduce_indptr"], **i32)
    t["aiter_reduce_final_map"] = torch.tensor(plan["final"], **i32)
    t["aiter_reduce_partial_map"] = torch.tensor(plan["partial"], **i32)
    meta = make_meta(SPEC)
    meta["aiter_kernel_heads"] = HEADS
    write_capture(path, t, meta, compact=False)
    return str(path)


def inspect(path) -> tuple[int, dict, str]:
    code, out, err = run_cli("inspect", path, "--json")
    text = run_cli("inspect", path)[1]
    return code, json.loads(out), text


@pytest.fixture(scope="module")
def kv_indptr():
    return make_inputs(SPEC)["kv_indptr"]


def test_a_correct_plan_is_clean(tmp_path, kv_indptr):
    code, entry, text = inspect(write_with_plan(tmp_path / "ok.safetensors", aiter_plan(kv_indptr)))
    plan = entry["plan"]
    assert plan["ok"] and plan["violations"] == [] and plan["first"] is None, plan
    assert plan["kernel_heads"] == HEADS and plan["work_items"] == sum(-(-L // GRANULARITY) for L in SPEC.seq_lens)
    assert code == 0 and "plan     ok" in text


def test_one_item_misrouted_and_one_range_repeated_are_both_named(tmp_path, kv_indptr):
    plan = aiter_plan(kv_indptr)
    works = plan["works"]
    # request 2's fourth chunk routed to request 3 (its KV stays request 2's entries)
    moved = [i for i, w in enumerate(works) if w[0] == 2][3]
    works[moved][0] = 3
    # request 0's second chunk done twice: the copy runs on the last CU with a partial row of its own
    again = [i for i, w in enumerate(works) if w[0] == 0][1]
    works.append(list(works[again]))
    works[-1][1] = len(plan["partial"])  # a partial row of its own, merged in request 0's reduce tile
    plan["partial"].insert(plan["reduce_indptr"][1], works[-1][1])
    plan["reduce_indptr"] = plan["reduce_indptr"][:1] + [x + 1 for x in plan["reduce_indptr"][1:]]
    plan["work_indptr"][-1] = len(works)
    code, entry, text = inspect(write_with_plan(tmp_path / "bad.safetensors", plan))
    found = entry["plan"]
    kinds = [v["kind"] for v in found["violations"]]
    assert code == 1 and not found["ok"], found
    misrouted = next(v for v in found["violations"] if v["kind"] == "work_item_misrouted")
    assert misrouted["detail"]["work_item"] == moved and misrouted["detail"]["request"] == 3
    assert misrouted["detail"]["reads_request"] == 2
    repeated = next(v for v in found["violations"] if v["kind"] == "kv_range_repeated")
    assert repeated["detail"]["request"] == 0 and repeated["detail"]["positions"] == [16, 32]
    assert repeated["detail"]["work_items"] == [again, len(works) - 1] and repeated["detail"]["heads"] == [0, HEADS]
    assert found["first"] == found["violations"][0] and found["first"]["kind"] == "work_item_misrouted"
    assert "kv_range_uncovered" in kinds  # request 2's chunk that left: done by no item of its own
    assert "partials_misaddressed" in kinds  # its partial now reduced into request 2's row by request 3's item
    assert "plan     VIOLATIONS" in text and "first: work_item_misrouted" in text


def test_a_previous_batchs_item_is_stale(tmp_path, kv_indptr):
    plan = aiter_plan(kv_indptr)
    plan["works"].append([5, -1, 5, 6, 400, 416, 0, HEADS << 16])  # request 5 of a batch of 4
    plan["work_indptr"][-1] = len(plan["works"])
    code, entry, _ = inspect(write_with_plan(tmp_path / "stale.safetensors", plan))
    assert code == 1 and entry["plan"]["first"]["kind"] == "work_list_stale", entry["plan"]
    assert entry["plan"]["first"]["detail"]["work_item"] == len(plan["works"]) - 1


def test_a_garbage_plan_is_a_finding_not_an_invalid_capture(tmp_path, kv_indptr):
    plan = aiter_plan(kv_indptr)
    plan["work_indptr"][-1] = len(plan["works"]) + 50  # past the list (the buffer's torch.empty tail)
    plan["works"][0][2:4] = [0, 1 << 30]  # a query range of a billion rows
    code, entry, _ = inspect(write_with_plan(tmp_path / "garbage.safetensors", plan))
    kinds = {v["kind"] for v in entry["plan"]["violations"]}
    assert code == 1 and entry["metadata"]["ok"], entry
    assert "work_list_stale" in kinds, kinds
    assert any(v["detail"].get("work_item") == 0 for v in entry["plan"]["violations"])  # the billion-row item named
    assert any(v["detail"].get("work_items") == len(plan["works"]) + 50 for v in entry["plan"]["violations"])
