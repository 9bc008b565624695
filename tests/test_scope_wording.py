"""The note and the JSON say the same scope, and a class that depends on which paths ran says so:
``--fault qlen_pow2_padding`` (a whole-output masking mistake) replayed with ``--backend reference``."""

import json

import pytest

from hostile import run_cli
from refmla.api import synth
from refmla.diagnosis import diagnose_verify
from refmla.results import Explanation


def test_a_whole_output_explanation_says_all_requests():
    e = Explanation("qlen_pow2_padding", 1, {"qlen": 3}, 0.0, extra={"scope": "all requests"})
    assert e.text() == "explained by qlen_pow2_padding(qlen=3) all requests (worst request 1)"
    one = Explanation("seq_len_off_by", 3, {"delta": -1}, 0.0, extra={"scope": "request"})
    assert one.text() == "explained by seq_len_off_by(delta=-1) request 3"


def test_production_alone_on_a_verify_capture_says_what_other_paths_would_decide():
    d = diagnose_verify({"observed": "fail"})
    assert d.name == "verify" and "no offline path ran" in d.text and "observed when an offline path agrees" in d.text
    # with an offline verify path agreeing it is observed: the two classes differ for a reason the text gives
    assert diagnose_verify({"observed": "fail", "extend": "pass", "triton_decode_per_query": "pass"}).name == "observed"


@pytest.fixture(scope="module")
def padded(tmp_path_factory):
    path = tmp_path_factory.mktemp("q") / "q.safetensors"
    synth(path, "kimi-k2-tp8-mtp", fault="qlen_pow2_padding")
    return path


def test_table_note_and_json_scope_agree(padded):
    code, out, _ = run_cli("replay", str(padded), "--backend", "reference", "--json")
    expl = json.loads(out)["backends"]["observed"]["explanation"]
    assert code == 1 and expl["scope"] == "all requests"
    code, out, _ = run_cli("replay", str(padded), "--backend", "reference")
    note = next(ln for ln in out.splitlines() if ln.startswith("observed "))
    assert "all requests (worst request" in note
    assert "diagnosis verify:" in out and "observed when an offline path agrees" in out
