"""The sparse reference and its hypothesis search do work that follows the attended entries x heads:
rows in blocks (one bmm pair a block, never a Python step per query token or per head), each
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
    """Calls to the sparse attention (rows per call) and to the token decoder (tokens per call)."""
    calls = {"attention": [], "decode": []}
    real_attention, real_decode = sref.sparse_attention, sref.dequantize

    def attention(q, keys, *a, **k):
        calls["attention"].append(q.shape[0])
        return real_attention(q, keys, *a, **k)

    def decode(cache, layout, page, fp8="float8_e4m3fn", tokens=None):
        calls["decode"].append(None if tokens is None else len(tokens))
        return real_decode(cache, layout, page, fp8, tokens)

    monkeypatch.setattr(sref, "sparse_attention", attention)
    monkeypatch.setattr(shyp, "sparse_attention", attention)
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
    blocks = sref.row_blocks(rows, cap.q.shape[-1])
    assert counted["attention"] == [b.stop - b.start for b in blocks]  # one call a block of rows, all heads at once
    assert len(blocks) <= -(-requests * topk * 576 * 8 // sref.ROW_BLOCK_BYTES) + 1
    distinct = torch.unique(cap.indices[cap.indices >= 0]).numel()
    assert counted["decode"] == [distinct]  # each attended token decoded once for the whole call
    assert ref.out.shape == (requests, 1, heads, 512) and bool(torch.isfinite(ref.out).all())


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
