"""What to do after ``observed``: the report (text and JSON) names the captures and commands that
tell its four causes apart; other diagnoses carry none.

The production output is made to diverge by overwriting the capture's ``out`` directly."""

import json

from hostile import run_cli, write_small
from refmla.diagnosis import OBSERVED_CAUSES, diagnose
from refmla.nextsteps import CAUSES, after_observed


def _out_off(t, m):
    t["out"][1] = t["out"][1] * 1.25  # request 1's output is off; the inputs are untouched


def test_observed_names_its_causes_and_others_none():
    assert diagnose({"observed": "fail", "triton": "pass"}).causes == OBSERVED_CAUSES
    assert set(OBSERVED_CAUSES) == set(CAUSES)
    assert diagnose({"observed": "fail", "triton": "fail"}).causes == ()  # decode: the kernel, one cause
    unreplayed = diagnose({"observed": "fail", "triton": "pass"}, unreplayed=("persistent", "not installed"))
    assert unreplayed.name == "observed" and unreplayed.causes == ()  # it names the kernel to replay instead
    masking = diagnose({"observed": "fail", "extend": "pass"}, explained={"observed": ("causal_alignment", {})})
    assert masking.name == "observed" and masking.causes == ()


def test_every_cause_has_a_step_that_tells_it_apart():
    class Meta:
        layer_id, tp_rank, step, backend, extra = 3, 1, 10, "triton", {"disagg_mode": "decode", "sglang_version": "0.5.9"}

    steps = after_observed(OBSERVED_CAUSES, "/d/cap one.safetensors", Meta(), ["triton"])
    assert [s.name for s in steps] == ["another_step", "repeat", "disagg", "graphs_off", "writer"]
    assert {c for s in steps for c in s.causes} == set(OBSERVED_CAUSES)
    assert "steps 9 and 11 of layer 3 rank 1" in steps[0].run and "--layers 3 --ranks 1" in steps[0].run
    assert "refmla replay '/d/cap one.safetensors' --backend triton --repeat 20" in steps[1].run
    assert "sglang_version 0.5.9" in steps[1].run
    assert "refmla disagg PREFILL_DIR DECODE_DIR" in steps[2].run and not steps[2].run.startswith("if")
    Meta.extra = {"disagg_mode": "null"}  # not a disaggregated decode: no disagg step
    assert "disagg" not in [s.name for s in after_observed(OBSERVED_CAUSES, "c", Meta(), ["triton"])]


def test_replay_report_says_what_to_do_after_observed(tmp_path):
    path = write_small(tmp_path / "off.safetensors", _out_off)
    code, out, _ = run_cli("replay", str(path), "--backend", "triton", "--backend", "observed", "--no-explain")
    assert code == 1 and "diagnosis observed:" in out
    lines = out.splitlines()
    at = lines.index("next     to tell these causes apart:")
    assert [ln.split(":")[0].strip() for ln in lines[at + 1 : at + 6]] == [
        "another_step", "repeat", "disagg", "graphs_off", "writer"]
    code, out, _ = run_cli("replay", str(path), "--backend", "triton", "--backend", "observed", "--no-explain", "--json")
    steps = json.loads(out)["next_steps"]
    assert [s["step"] for s in steps] == ["another_step", "repeat", "disagg", "graphs_off", "writer"]
    assert all(s["run"] and s["tells"] and s["causes"] for s in steps)


def test_a_clean_replay_has_no_next_steps(tmp_path):
    path = write_small(tmp_path / "clean.safetensors")
    code, out, _ = run_cli("replay", str(path), "--backend", "observed", "--json")
    assert code == 0 and "next_steps" not in json.loads(out)
