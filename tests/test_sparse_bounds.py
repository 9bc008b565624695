"""The sparse reference and its hypothesis search do work that follows the attended entries x heads:
every row over one table of the call's keys by the dense reference's blocked work (refmla.blocked:
never a Python step per query token or per head; past the table's budget, blocks of rows), each
attended token decoded once a call, and a search that computes a candidate on the failing rows
before the whole call and stops at its budget with what it tried. No timings here: the work's
structure is asserted (call counts, rows per call); tools/bench_sparse.py measures the seconds.

The captures are built by tools/bench_sparse.py: production's output by its own plain fp64
softmax, a wrong head planted by this file (x 1.5 + 0.01), not by the code measured.
"""

from __future__ import annotations

import pytest
import torch

from helpers import load_tool
from refmla.options import ReplayOptions
from refmla.pipeline import replay_file
from refmla.sparse import reference as sref
from refmla.sparse import hypotheses as shyp
from refmla.sparse.validation import read_sparse


@pytest.fixture
def counted(monkeypatch):
    """Calls to the sparse attention over a key table (rows per call) and to the token decoder
    (tokens per call)."""
    calls = {"attention": [], "decode": []}
    real_attention, real_decode = sref.attend_table, sref.dequantize

    def attention(q, *a, **k):
        calls["attention"].append(q.shape[0])
        return real_attention(q, *a, **k)

    def decode(cache, layout, page, fp8="float8_e4m3fn", tokens=None):
        calls["decode"].append(None if tokens is None else len(tokens))
        return real_decode(cache, layout, page, fp8, tokens)

    monkeypatch.setattr(sref, "attend_table", attention)
    monkeypatch.setattr(sref, "dequantize", decode)
    return calls


def build(tmp_path, name, requests, topk, heads, wrong=None):
    path = tmp_path / f"{name}.safetensors"
    load_tool("bench_sparse").build(path, requests, topk, heads, wrong)
    return path


@pytest.mark.parametrize("requests,topk,heads", [(3000, 1, 16), (1, 1, 4096), (24, 256, 16)])
def test_the_reference_batches_rows_and_decodes_each_token_once(tmp_path, counted, requests, topk, heads):
    cap = read_sparse(build(tmp_path, "c", requests, topk, heads))
    rows = sref.rows_of(cap)
    ref = sref.sparse_reference(cap, rows)
    assert counted["attention"] == [requests]  # one blocked attention of every row, all heads at once
    distinct = torch.unique(cap.indices[cap.indices >= 0]).numel()
    assert counted["decode"] == [distinct]  # each attended token decoded once for the whole call
    assert ref.out.shape == (requests, 1, heads, 512) and bool(torch.isfinite(ref.out).all())


def test_the_reference_past_its_table_budget_works_in_row_blocks_with_the_same_result(tmp_path, counted, monkeypatch):
    cap = read_sparse(build(tmp_path, "c", 40, 64, 16, (3, 1)))
    whole = sref.sparse_reference(cap)
    monkeypatch.setattr(sref, "TABLE_BYTES", 64 * 576 * 8 * 7)  # no table of the whole call: 7 rows a table
    cap = read_sparse(cap.path)
    counted["attention"].clear()
    blocked = sref.sparse_reference(cap)
    assert counted["attention"] == [7] * 5 + [5]
    assert torch.equal(blocked.out, whole.out) and torch.equal(blocked.lse, whole.lse)  # a row's bits: its own


def test_the_search_computes_each_candidate_on_the_failing_rows_first(tmp_path, counted):
    requests, wrong = 48, (17, 3)
    path = build(tmp_path, "faulty", requests, 256, 16, wrong)
    r = replay_file(str(path), ReplayOptions(backends=["reference", "observed"]))
    obs = r.backends["observed"]
    assert r.verdict == "diverged" and obs.status == "fail"
    assert obs.localization.requests == [wrong[0]] and obs.localization.heads[wrong[0]] == [wrong[1]]
    n = len(shyp.mistakes(read_sparse(path)))
    whole = [c for c in counted["attention"] if c > 1]  # the reference's, the control's and a survivor's blocks
    one_row = [c for c in counted["attention"] if c == 1]  # a candidate on the one failing query row
    assert len(one_row) >= n  # every candidate screened on the failing row
    assert sum(whole) <= 3 * requests  # the reference, and no candidate, over the whole call (the control has its own)


def test_a_search_past_its_budget_stops_and_says_what_it_tried(tmp_path, monkeypatch):
    monkeypatch.setenv("REFMLA_SEARCH_SECONDS", "0")
    wrong = (5, 2)
    path = build(tmp_path, "faulty", 8, 64, 16, wrong)
    r = replay_file(str(path), ReplayOptions(backends=["reference", "observed"]))
    obs = r.backends["observed"]
    assert obs.status == "fail" and obs.explanation is None
    said = obs.info["search_skipped"]
    assert "stopped at its budget (0 s" in said and "0 of" in said and "not tried: " in said, said
    assert obs.localization.requests == [wrong[0]] and obs.localization.heads[wrong[0]] == [wrong[1]]


@pytest.mark.parametrize("value,expected", [("12.5", 12.5), ("0", 0.0), ("-1", shyp.SEARCH_SECONDS),
                                            ("nan", shyp.SEARCH_SECONDS), ("soon", shyp.SEARCH_SECONDS)])  # fmt: skip
def test_the_search_budget_is_read_from_the_environment(monkeypatch, value, expected):
    monkeypatch.setenv("REFMLA_SEARCH_SECONDS", value)
    assert shyp.search_seconds() == expected and shyp.SEARCH_SECONDS == 30.0
