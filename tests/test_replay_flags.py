"""One option parser for every command that replays (issue 22, part 6): the same flags, the same
bounds, the same one-line usage error naming the flag, in `replay` and `disagg` alike."""

from __future__ import annotations

import argparse

import pytest

from hostile import error_lines, run_cli, write_small
from refmla.cli import build_parser
from refmla.compare import Tolerance
from refmla.options import BOUNDS, ReplayOptions

REPLAY_FLAGS = ("--backend", "--json", "--k", "--ulps", "--cos", "--device", "--cu-count", "--jobs", "--plot",
                "--no-explain", "--repeat")  # fmt: skip
BAD = [("--k", "1e300"), ("--k", "nan"), ("--k", "-1"), ("--k", "inf"), ("--ulps", "-5"), ("--ulps", "1e7"),
       ("--cos", "nan"), ("--cos", "3"), ("--jobs", "0"), ("--jobs", "two"), ("--cu-count", "0"),
       ("--cu-count", "-4"), ("--repeat", "0"), ("--repeat", "1.5")]  # fmt: skip


def command(name: str, capture: str) -> list[str]:
    return ["replay", capture] if name == "replay" else ["disagg", capture, capture]


@pytest.fixture(scope="module")
def capture(tmp_path_factory):
    return str(write_small(tmp_path_factory.mktemp("flags") / "a.safetensors"))


@pytest.mark.parametrize("name", ["replay", "disagg"])
@pytest.mark.parametrize("flag,value", BAD)
def test_a_bad_flag_exits_2_with_one_line_naming_it(capture, name, flag, value):
    code, out, err = run_cli(*command(name, capture), flag, value)
    assert code == 2 and out == "", (code, out, err)
    lines = error_lines(err)
    assert len(lines) == 1 and f"argument {flag}" in lines[0], lines


@pytest.mark.parametrize("name", ["replay", "disagg"])
def test_the_bounds_themselves_are_accepted(capture, name):
    """--k 1e6 and --cos 2 are the largest values the arithmetic supports: they parse and the replay runs."""
    code, out, err = run_cli(*command(name, capture), "--k", "1e6", "--ulps", "0", "--cos", "2", "--backend",
                             "reference", "--no-explain")  # fmt: skip
    assert code in (0, 1) and not any("argument" in ln for ln in error_lines(err)), err


def test_every_replaying_command_has_the_same_flags():
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    flags = {}
    for name in ("replay", "disagg"):
        parser = sub.choices[name]
        flags[name] = {opt: a.type for a in parser._actions for opt in a.option_strings if opt in REPLAY_FLAGS}
        assert set(flags[name]) == set(REPLAY_FLAGS), name
    assert flags["replay"].keys() == flags["disagg"].keys()
    for opt in REPLAY_FLAGS:  # the same validation: the same type function names the same bound
        a, b = flags["replay"][opt], flags["disagg"][opt]
        assert (a is None) == (b is None) and getattr(a, "__name__", None) == getattr(b, "__name__", None), opt


@pytest.mark.parametrize("tol", [Tolerance(k=1e300), Tolerance(k=float("nan")), Tolerance(ulps=-5.0),
                                 Tolerance(cos=float("nan"))])  # fmt: skip
def test_the_api_refuses_what_the_cli_refuses(tol):
    with pytest.raises(ValueError, match="option (k|ulps|cos)"):
        ReplayOptions(tol=tol).check()
    ReplayOptions(tol=Tolerance(k=BOUNDS["k"][1], ulps=BOUNDS["ulps"][1], cos=BOUNDS["cos"][1])).check()


def test_the_api_refuses_an_unknown_extend_impl_and_a_huge_page_size():
    with pytest.raises(ValueError, match="extend_impl"):
        ReplayOptions(extend_impl="fast").check()
    with pytest.raises(ValueError, match="aiter_page_size"):
        ReplayOptions(aiter_page_size=1 << 20).check()


def test_the_api_entry_points_check_the_same_bounds(capture):
    from refmla.batch import replay_many

    with pytest.raises(ValueError, match="option k"):
        replay_many([capture], ReplayOptions(tol=Tolerance(k=1e300)))
    with pytest.raises(ValueError, match="option jobs"):
        replay_many([capture], ReplayOptions(), jobs=0)


@pytest.mark.parametrize("preset", ["kv-write-bf16", "merge-cp-log2"])
def test_plot_refuses_a_kv_writer_or_merge_capture_in_one_line(tmp_path, preset):
    """--plot draws dense attention captures; a KV writer's or a merge's capture is refused in one
    stderr line (it was skipped in silence), its replay unchanged."""
    pytest.importorskip("matplotlib")
    path = tmp_path / "c.safetensors"
    assert run_cli("synth", str(path), "--preset", preset)[0] == 0
    code, out, err = run_cli("replay", str(path), "--plot", str(tmp_path / "plots"))
    said = [ln for ln in error_lines(err) if "--plot" in ln]
    assert code == 0 and "agree" in out, (code, out[-500:], err[-500:])
    assert len(said) == 1 and str(path) in said[0] and "not drawn" in said[0], err
    assert not list((tmp_path / "plots").glob("c*"))
