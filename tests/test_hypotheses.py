"""Planted faults (refmla.synthetic) are found: the failing backend, the worst request, the hypothesis
and its detail (docs/contract.md section 4); clean captures agree and exit 0."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from refmla.capture import read_capture, write_capture
from refmla.cli import main as cli
from refmla.hypotheses import HYPOTHESES, explain_failure
from refmla.context import ReplayContext, ReplayOptions
from refmla.synthetic import MIN_BLOCK_KV, SynthSpec, faulty_output, make_inputs, make_meta, preset, synth_capture

KIMI = preset("kimi-k2-tp8")  # 8 heads, page size 1, seq_lens (611, 257, 1024, 33), fault on request 2
# a small softmax scale keeps the logits near 0, where all-zero rows weigh as much as real ones:
# "dropped" and "zeroed" become distinguishable (at Kimi's scale a zero row weighs ~exp(-10))
FLAT = dataclasses.replace(KIMI, name="flat-logits", sm_scale=0.01)


@pytest.fixture(autouse=True)
def torch_extend(monkeypatch):
    monkeypatch.setenv("REFMLA_EXTEND_IMPL", "torch")  # the Triton extend is tested in test_extend.py


def replay_json(capsys, path, *backends: str) -> tuple[int, dict]:
    args = ["replay", str(path), "--json"]
    for b in backends or ("extend",):
        args += ["--backend", b]
    code = cli(args)
    return code, json.loads(capsys.readouterr().out)


def planted_case(tmp_path, spec: SynthSpec, fault: str):
    path = tmp_path / f"{spec.name}-{fault}.safetensors"
    planted = synth_capture(path, spec, fault)
    return path, planted


# (spec, fault, expected hypothesis, expected detail: key -> value or a predicate)
CASES = [
    (KIMI, "seq_len_off_by", "seq_len_off_by", {"delta": -1}),
    (KIMI, "split_missing", "split_missing", {"split": 1}),
    (FLAT, "kv_range_missing", "kv_range_missing", {"start": MIN_BLOCK_KV, "end": 2 * MIN_BLOCK_KV, "how": "dropped"}),
    (FLAT, "kv_range_zero", "kv_range_missing", {"start": MIN_BLOCK_KV, "end": 2 * MIN_BLOCK_KV, "how": "zeroed"}),
    (preset("kimi-k2-tp8-page256"), "kv_range_missing", "kv_range_missing", {"start": 256, "end": 512}),
    (preset("hostile"), "kv_range_zero", "kv_range_missing", {"start": 16, "end": 32}),
    (KIMI, "wrong_sm_scale", "wrong_sm_scale", {"ratio": (192**-0.5) / KIMI.sm_scale}),
    (KIMI, "head_misaligned", "head_misaligned", {"heads": [0, 0, 1, 1, 2, 2, 3, 3]}),
    (preset("deepseek-v3-tp8"), "head_misaligned", "head_misaligned", {"heads": [15] + list(range(15))}),
    (KIMI, "logit_cap_mismatch", "logit_cap_mismatch", {"logit_cap": 30.0}),
    (
        dataclasses.replace(KIMI, name="capped", logit_cap=30.0),
        "logit_cap_mismatch",
        "logit_cap_mismatch",
        {"logit_cap": 0.0},
    ),
    (preset("kimi-k2-tp8-extend"), "seq_len_off_by", "seq_len_off_by", {"delta": -1}),
]
PER_REQUEST = {"seq_len_off_by", "kv_range_missing", "split_missing"}


@pytest.mark.parametrize("spec,fault,hypothesis,detail", CASES, ids=[f"{c[0].name}-{c[1]}" for c in CASES])
def test_planted_fault_is_named(tmp_path, capsys, spec, fault, hypothesis, detail):
    path, planted = planted_case(tmp_path, spec, fault)
    code, report = replay_json(capsys, path)
    assert code == 1 and report["verdict"] == "diverged"
    assert report["diagnosis"] == "observed"  # the offline path agrees: only production diverged
    assert report["backends"]["extend"]["status"] == "pass"
    obs = report["backends"]["observed"]
    assert obs["status"] == "fail"
    e = obs["explanation"]
    assert e["hypothesis"] == hypothesis, e
    for key, want in detail.items():
        if isinstance(want, float):
            assert e["detail"][key] == pytest.approx(want, rel=1e-9), e
        else:
            assert e["detail"][key] == want, e
    if hypothesis in PER_REQUEST:
        assert obs["worst"]["request"] == planted["request"] == e["request"]
        assert "requests" not in e  # only the faulty request was changed
    else:
        assert e["request"] == obs["worst"]["request"]
    assert e["residual_ratio"] <= 1.0  # back within tolerance on every row


def test_hypotheses_in_contract_order():
    assert HYPOTHESES == ("numerics", "last_page_read_full", "empty_split_merged", "seq_len_off_by",
                          "newest_kv_unwritten", "offset_overflow", "last_page_len_swapped", "draft_kv_missing",
                          "causal_alignment", "mask_wrong_request", "qlen_pow2_padding", "block_table_read_off",
                          "other_table_row_read", "pages_read_off",
                          "other_request_read", "other_rows_read", "kv_range_missing", "null_block_read", "pages_as_tokens",
                          "split_missing", "kv_range_repeated", "work_item_misrouted", "partials_misaddressed",
                          "kv_fp8_encoding_mismatch", "kv_scale_misapplied", "kv_scale_format", "kv_page_stride", "wrong_sm_scale",
                          "heads_folded", "head_misaligned",
                          "output_rows_permuted", "rope_mishandled", "logit_cap_mismatch", "padded_row_leak")  # fmt: skip


@pytest.mark.parametrize("name", ["kimi-k2-tp8", "hostile", "kimi-k2-tp8-extend"])
def test_clean_capture_agrees(tmp_path, capsys, name):
    path, _ = planted_case(tmp_path, preset(name), "none")
    code, report = replay_json(capsys, path)
    assert code == 0 and report["verdict"] == "agree" and report["diagnosis"] is None
    assert all(b["status"] in ("pass", "skipped") for b in report["backends"].values())
    assert not any("explanation" in b for b in report["backends"].values())


def test_clean_capture_every_backend(tmp_path, capsys):
    """Every backend usable here passes on a clean capture (small: the Triton kernels interpret)."""
    spec = SynthSpec(name="small", num_heads=8, seq_lens=(45, 7, 64), page_size=16, seed=5)
    path, _ = planted_case(tmp_path, spec, "none")
    code = cli(["replay", str(path), "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["diagnosis"] is None, report
    statuses = {n: b["status"] for n, b in report["backends"].items()}
    assert set(statuses) == {"reference", "observed", "triton", "aiter", "extend"}
    assert set(statuses.values()) <= {"pass", "skipped"}
    for n, b in report["backends"].items():
        if b["status"] == "skipped":
            assert b["reason"], n


def test_several_requests_each_with_its_detail(tmp_path):
    """Requests 2 and 3 both attended one token too few: one hypothesis, both listed, worst first."""
    spec = KIMI
    t = make_inputs(spec)
    out, _ = faulty_output(spec, t, "none")
    for r in (2, 3):
        bad, _ = faulty_output(dataclasses.replace(spec, fault_request=r), t, "seq_len_off_by")
        out[r] = bad[r]
    t["out"] = out
    write_capture(tmp_path / "two.safetensors", t, make_meta(spec), compact=False)
    cap = read_capture(tmp_path / "two.safetensors")
    ctx = ReplayContext(cap, ReplayOptions(backends=[]))
    cmp = ctx.compare("observed", cap.out, row_mask=~ctx.empty_rows())
    assert not cmp.passed
    e = explain_failure(ctx, cap.out, cmp)
    assert e.hypothesis == "seq_len_off_by" and e.detail == {"delta": -1}
    assert sorted(x["request"] for x in e.extra["requests"]) == [2, 3]
    assert all(x["detail"] == {"delta": -1} for x in e.extra["requests"])
    assert e.request == cmp.worst.request
    assert e.to_json()["requests"] == e.extra["requests"]


def test_unexplained_failure_has_no_explanation(tmp_path):
    """Noise on one row is no planted fault: it fails and no hypothesis claims it."""
    path, _ = planted_case(tmp_path, KIMI, "none")
    cap = read_capture(path)
    g = torch.Generator().manual_seed(0)
    cap.out = cap.out.clone()
    cap.out[1, 3] += (0.05 * torch.randn(cap.out.shape[-1], generator=g)).to(cap.out.dtype)
    ctx = ReplayContext(cap, ReplayOptions(backends=[]))
    cmp = ctx.compare("observed", cap.out, row_mask=~ctx.empty_rows())
    assert not cmp.passed and cmp.worst.request == 1
    assert explain_failure(ctx, cap.out, cmp) is None


def test_human_report_names_path_and_hypothesis(tmp_path, capsys):
    path, _ = planted_case(tmp_path, KIMI, "split_missing")
    assert cli(["replay", str(path), "--backend", "extend"]) == 1
    text = capsys.readouterr().out
    assert "diagnosis observed" in text
    assert "explained by split_missing(split=1) request 2" in text


@pytest.mark.parametrize(
    "statuses,name,about",
    [
        ({"observed": "pass", "triton": "pass", "aiter": "skipped", "extend": "pass"}, None, []),
        ({"observed": "fail", "triton": "pass", "extend": "pass"}, "observed", ["observed"]),
        ({"observed": "fail", "extend": "pass"}, "observed", ["observed"]),
        ({"observed": "fail", "extend": "skipped"}, "observed_unconfirmed", ["observed"]),
        ({"observed": "fail", "triton": "fail", "extend": "pass"}, "decode", ["triton", "observed"]),
        ({"observed": "pass", "aiter": "fail", "extend": "pass"}, "decode", ["aiter"]),
        ({"observed": "fail", "triton": "fail", "extend": "fail"}, "shared_input", ["triton", "extend"]),
        ({"observed": "fail", "extend": "fail"}, "shared_input", ["observed", "extend"]),
        ({"observed": "pass", "triton": "pass", "extend": "fail"}, "extend", ["extend"]),
        ({"observed": "pass", "triton": "error", "extend": "pass"}, "backend_error", ["triton"]),
    ],
)
def test_diagnosis_classes(statuses, name, about):
    from refmla.diagnosis import diagnose

    d = diagnose({"reference": "pass", **statuses})
    assert (d.name, d.backends) == (name, about)
    assert d.text and "{" not in d.text


def test_diagnosis_invalid():
    from refmla.diagnosis import diagnose

    assert diagnose({}, invalid=True).name == "metadata"


@pytest.mark.parametrize("source", ["req_to_token", "page_tail"])
def test_one_token_too_many(tmp_path, source):
    """seq_len + 1: the row after the end comes from req_to_token, else from the last page's tail
    (NaN in synth pools: a kernel that reads past the end writes NaN, and that is explained too)."""
    from refmla import reference as ref

    spec = preset("hostile")  # page size 16; request 3 has 300 tokens, 4 free slots in its last page
    t = make_inputs(spec)
    r, ptr = 3, t["kv_indptr"].long()
    rows = t["kv_indices"][ptr[r] : ptr[r + 1]].long()
    if source == "req_to_token":
        used = set(t["kv_indices"].tolist()) | set(range(int(rows[-1]) - int(rows[-1]) % 16, int(rows[-1]) + 16))
        nxt = torch.tensor(next(x for x in range(t["kv_buffer"].shape[0]) if x not in used))  # a free page's slot
        t["kv_buffer"][nxt, 0] = (t["q"][r, 0].float() / 8).to(t["kv_buffer"].dtype)  # one head attends it strongly
        lens = t["seq_lens"].long()
        r2t = torch.full((len(lens), int(lens.max()) + 8), -1, dtype=torch.int64)
        for b in range(len(lens)):
            r2t[b, : lens[b]] = t["kv_indices"][ptr[b] : ptr[b + 1]].long()
        r2t[r, lens[r]] = nxt
        t["req_to_token"] = r2t.to(torch.int32)
    else:
        nxt = rows[-1] + 1  # the next slot of the last page
    out, _ = faulty_output(spec, t, "none")
    sc = ref.Scales(spec.kv_lora_rank, spec.sm_scale)
    kv = t["kv_buffer"][torch.cat([rows, nxt.view(1)]), 0].double()
    out[r] = ref.attend(t["q"][r].double(), kv, sc)[0].to(out.dtype)
    t["out"] = out
    write_capture(tmp_path / "plus1.safetensors", t, make_meta(spec), compact=False)
    cap = read_capture(tmp_path / "plus1.safetensors")
    ctx = ReplayContext(cap, ReplayOptions(backends=[]))
    cmp = ctx.compare("observed", cap.out, row_mask=~ctx.empty_rows())
    assert not cmp.passed
    assert torch.isnan(cap.out[r]).all() == (source == "page_tail")
    e = explain_failure(ctx, cap.out, cmp)
    assert (e.hypothesis, e.request, e.detail) == ("seq_len_off_by", r, {"delta": 1})


# --------------------------------------------------------------------------------------------
# The simplest explanation, and the alternatives that fit as well (issue 11, part 1)
# --------------------------------------------------------------------------------------------

SHORT = preset("kimi-k2-tp8", seq_lens=(611, 257, 300, 33))  # request 2 has 300 tokens


def dropped_last_token(tmp_path, light_tail: int):
    """Request 2 (300 tokens) computed without its last token; the ``light_tail`` tokens before it
    get rows 20x smaller (logits near 0: next to no softmax weight), so dropping them too fits."""
    t = make_inputs(SHORT)
    ptr = t["kv_indptr"].long()
    rows = t["kv_indices"][ptr[2] : ptr[3]].long()
    if light_tail:
        tail = rows[-1 - light_tail : -1]
        t["kv_buffer"][tail] = (t["kv_buffer"][tail].double() * 0.05).to(t["kv_buffer"].dtype)
    t["out"], planted = faulty_output(SHORT, t, "seq_len_off_by")
    assert planted == {"fault": "seq_len_off_by", "request": 2, "delta": -1}
    path = tmp_path / f"tail{light_tail}.safetensors"
    write_capture(path, t, make_meta(SHORT), compact=False)
    return path


def confirming_deltas(path) -> tuple[list[int], object]:
    """Every delta the comparator passes on request 2's rows (the search's own candidates), and
    the search's explanation."""
    from refmla.hypotheses import seq_len
    from refmla.hypotheses.search import Search

    cap = read_capture(path)
    ctx = ReplayContext(cap, ReplayOptions(backends=[]))
    cmp = ctx.compare("observed", cap.out, row_mask=~ctx.empty_rows())
    assert not cmp.passed and cmp.worst.request == 2
    s = Search(ctx, cap.out, cmp)
    ok = [c.detail["delta"] for c in seq_len.find_seq_len(s, 2) if s.confirm(c.expected, c.control, s.rows_of(2)).passed]
    return sorted(ok, key=abs), explain_failure(ctx, cap.out, cmp)


@pytest.mark.parametrize("light_tail", [0, 2])
def test_dropped_last_token_reports_delta_minus_one(tmp_path, light_tail):
    ok, e = confirming_deltas(dropped_last_token(tmp_path, light_tail))
    assert -1 in ok
    if light_tail:
        assert {-2, -3} <= set(ok)  # the premise: the light tokens cannot be told apart
    assert e.hypothesis == "seq_len_off_by" and e.detail == {"delta": -1} and e.request == 2
    alts = [a.detail["delta"] for a in e.alternatives]
    assert sorted(alts, key=abs) == [d for d in ok if d != -1]
    assert all(a.hypothesis == "seq_len_off_by" and a.request == 2 and a.residual_ratio <= 1 for a in e.alternatives)
    assert e.explained_requests == [2] and e.unexplained_requests == []
    j = e.to_json()
    assert [a["detail"] for a in j["alternatives"]] == [{"delta": d} for d in alts]
    if light_tail:
        assert "; delta -2, -3 also fit within noise" in e.text()


def test_replay_json_lists_alternatives(tmp_path, capsys):
    code, report = replay_json(capsys, dropped_last_token(tmp_path, 2))
    e = report["backends"]["observed"]["explanation"]
    assert code == 1 and e["detail"] == {"delta": -1}
    assert {"hypothesis": "seq_len_off_by", "detail": {"delta": -2}} in [
        {k: a[k] for k in ("hypothesis", "detail")} for a in e["alternatives"]
    ]
    assert e["explained_requests"] == [2] and e["unexplained_requests"] == []


def test_simplest_beats_best_screening(tmp_path):
    """The candidate that screens best is not the one reported when a simpler one also confirms."""
    from refmla.hypotheses import seq_len
    from refmla.hypotheses.drivers import confirmed
    from refmla.hypotheses.search import Search

    cap = read_capture(dropped_last_token(tmp_path, 2))
    ctx = ReplayContext(cap, ReplayOptions(backends=[]))
    s = Search(ctx, cap.out, ctx.compare("observed", cap.out, row_mask=~ctx.empty_rows()))
    cands = list(seq_len.find_seq_len(s, 2))
    for c in cands:  # screening now favours the largest |delta|
        c.score = 1.0 / (1 + abs(c.detail["delta"]))
    hits = confirmed(s, iter(sorted(cands, key=lambda c: c.score)), s.rows_of(2), limit=None)
    assert [c.detail["delta"] for c, _ in hits][:3] == [-1, -2, -3]


def test_partial_explanation_names_unexplained_requests(tmp_path):
    """Request 2 dropped its last token, request 1 got noise: seq_len_off_by explains request 2
    only, and says so; no family explains both."""
    t = make_inputs(SHORT)
    out, _ = faulty_output(SHORT, t, "seq_len_off_by")
    g = torch.Generator().manual_seed(1)
    out[1, 3] += (0.006 * torch.randn(out.shape[-1], generator=g)).to(out.dtype)
    t["out"] = out
    write_capture(tmp_path / "partial.safetensors", t, make_meta(SHORT), compact=False)
    cap = read_capture(tmp_path / "partial.safetensors")
    ctx = ReplayContext(cap, ReplayOptions(backends=[]))
    cmp = ctx.compare("observed", cap.out, row_mask=~ctx.empty_rows())
    e = explain_failure(ctx, cap.out, cmp)
    assert e is not None and e.hypothesis == "seq_len_off_by" and e.detail == {"delta": -1}
    assert e.request == 2 == cmp.worst.request, cmp.worst
    assert e.explained_requests == [2] and e.unexplained_requests == [1] and not e.complete
    assert "request(s) 1 not explained" in e.text()


def test_fp8_pool_zeroed_range_is_explained(tmp_path):
    """Zeroing rows of an fp8 pool (no masked_fill for fp8) works: the range is named."""
    spec = preset("kimi-k2-tp8", kv_dtype=torch.float8_e4m3fn, k_scale=0.5, v_scale=0.5)
    path, planted = planted_case(tmp_path, spec, "kv_range_zero")
    cap = read_capture(path)
    ctx = ReplayContext(cap, ReplayOptions(backends=[]))
    cmp = ctx.compare("observed", cap.out, row_mask=~ctx.empty_rows())
    e = explain_failure(ctx, cap.out, cmp)
    assert e.hypothesis == "kv_range_missing" and e.request == planted["request"]
    assert (e.detail["start"], e.detail["end"]) == (planted["start"], planted["end"])


def test_a_failing_search_does_not_crash_replay(tmp_path, capsys, monkeypatch):
    import refmla.kinds.dense

    def broken(*a, **k):
        raise RuntimeError("boom")

    monkeypatch.setattr(refmla.kinds.dense, "explain_failure", broken)  # the dense kind's search
    path, _ = planted_case(tmp_path, KIMI, "seq_len_off_by")
    code, report = replay_json(capsys, path)
    obs = report["backends"]["observed"]
    assert code == 1 and obs["status"] == "fail" and "explanation" not in obs
    assert "boom" in obs["info"]["explain_error"]


def test_explanation_round_trips_through_json(tmp_path):
    """The golden results read explanations back from JSON: the typed keys survive."""
    from refmla.golden.result import explanation_from_json

    _, e = confirming_deltas(dropped_last_token(tmp_path, 2))
    back = explanation_from_json(json.loads(json.dumps(e.to_json())))
    assert back.to_json() == e.to_json() and back.alternatives == e.alternatives
