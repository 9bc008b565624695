"""Blame follows the failing part (issue 21 part 1): a backend failing only on its lse or its split
partials blames the rows that failed there -- in `refmla disagg`, in the table's worst column and
in the JSON ``worst`` of each part -- never the request of its worst (passing) ``out`` row."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from refmla.blame import failing_requests, worst_blame
from refmla.capture import read_capture, write_capture
from refmla.context import ReplayContext, ReplayOptions
from refmla.control import capture_control
from refmla.disagg import run_disagg
from refmla.render.replay import backend_row
from refmla.pipeline import replay_capture
from refmla.synthetic.disagg import disagg_preset, synth_disagg

OPTS = ReplayOptions(backends=["reference"])  # the observed capture is what is judged


def _guilty(path: Path) -> int:
    """A request other than the one of observed's worst (passing) ``out`` row: the old blame's pick."""
    worst = replay_capture(read_capture(path), OPTS).backends["observed"].worst.request
    return (worst + 1) % read_capture(path).batch_size


def _rewrite(path: Path, change, guilty: int) -> None:
    """The decode capture at ``path`` with the control's lse and split partials added (production
    writes them), then ``change(tensors)`` applied to them; ``out`` untouched."""
    cap = read_capture(path)
    t = dict(cap.tensors())
    _, lse = capture_control(cap, cap.out_dtype)
    S = int(cap.num_kv_splits.max())
    logits, split_lse, _ = ReplayContext(cap, OPTS).split_reference(cap.num_kv_splits, S, control=True)
    t.update(lse=lse.float(), attn_logits=logits.float(), attn_lse=split_lse.float())
    change(t, guilty)
    write_capture(path, t, cap.meta.to_json())


def _log2_units(t, b):
    t["lse"][b] = t["lse"][b] / math.log(2)  # the final lse in log2 units, for one request


def _bad_partial(t, b):
    t["attn_logits"][b, 0, 0] += 0.25  # request b, head 0, split 0: one partial row off


@pytest.fixture(scope="module", params=[_log2_units, _bad_partial], ids=["lse", "partials"])
def planted(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("blame")
    synth_disagg(root, disagg_preset("disagg-small"), "none")
    decode = sorted((root / "decode").glob("*.safetensors"))
    guilty = _guilty(decode[0])
    _rewrite(decode[0], request.param, guilty)
    return root, decode[0], request.param, guilty


def test_replay_blames_the_failing_part_of_the_right_request(planted):
    _, path, change, GUILTY = planted
    report = replay_capture(read_capture(path), OPTS)
    obs = report.backends["observed"]
    part = "lse" if change is _log2_units else "attn_logits"
    assert obs.status == "fail" and obs.failed_parts == [part]
    assert obs.comparison.passed  # every out row passes
    assert failing_requests(obs) == {part: {GUILTY}}
    blame = worst_blame(obs)
    assert (blame.part, blame.request) == (part, GUILTY)
    assert backend_row("observed", obs)[4].startswith(f"req {GUILTY} head ")  # the table's worst column
    check = obs.lse if part == "lse" else obs.splits
    assert check.to_json()["worst"]["request"] == GUILTY and check.to_json()["failed_requests"] == [GUILTY]


def test_disagg_blames_only_the_guilty_request(planted):
    root, path, _, GUILTY = planted
    rids = read_capture(path).meta.extra.get("rids") or read_capture(path).meta.to_json()["rids"]
    report = run_disagg(sorted(map(str, (root / "prefill").glob("*"))), sorted(map(str, (root / "decode").glob("*"))),
                        OPTS)  # fmt: skip
    layer = read_capture(path).meta.to_json().get("layer_id")
    rows = {r.rid: r for r in report.rows if r.layer == layer}
    assert rows[rids[GUILTY]].decode.verdict == "diverged"
    assert rows[rids[GUILTY]].decode.backends["observed"] == "fail"
    for b, rid in enumerate(rids):
        if b != GUILTY:
            assert rows[rid].decode.verdict == "agree", (rid, rows[rid].decode)
