"""Issue 22: hostile input, second round -- one test (or a few) per class of the issue's examples.

Escaped text, nothing hiding the rest (surrogates, depth, huge ints, a failing plot or renderer),
no user file touched, ranges never expanded, duplicate rids, NaN inputs as findings, bounded work.
Signals with --jobs are in tests/test_signals.py (real subprocesses).
"""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

from hostile import error_lines, reference_out, run_cli, write_small

RAW = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\ud800-\udfff]")  # what must never reach a terminal
NASTY = "tri\x1b[31mton\x07\nX\ud800\u202e"


def replay(*argv: str):
    return run_cli("replay", "--backend", "reference", "--no-explain", *argv)


# --- 2. escaped text ----------------------------------------------------------------------------


def test_printable_escapes_controls_surrogates_and_bidi():
    from refmla.util import printable

    assert printable("a\x1b[2J\x07\nb\ud800\u202e") == "a\\x1b[2J\\x07\\x0ab\\ud800\\u202e"
    assert printable("x\ny\tz", keep="\n\t") == "x\ny\tz"
    assert printable("plain text, ünïcode") == "plain text, ünïcode"


def test_meta_backend_and_unknown_tensor_names_are_escaped(tmp_path):
    def mutate(t, m):
        m["backend"] = NASTY
        t["zz\x1b[2J"] = torch.zeros(1)

    path = write_small(tmp_path / "c.safetensors", mutate)
    code, out, err = replay(str(path))
    assert code == 0 and not RAW.search(out + err)
    shape = next(ln for ln in out.splitlines() if ln.startswith("shape"))
    assert "produced by tri\\x1b[31mton\\x07\\x0aX\\ud800\\u202e" in shape  # one line, escaped
    assert "ignored: zz\\x1b[2J" in out
    code, out, _ = replay(str(path), "--json")  # JSON stays JSON: the value round-trips
    assert json.loads(out)["meta"]["backend"] == NASTY
    for argv in (["inspect", str(path)], ["inspect", str(path), str(path)]):
        code, out, err = run_cli(*argv)
        assert code == 1 and not RAW.search(out + err) and "ignored: zz\\x1b[2J" in out


def test_file_names_are_escaped_in_error_and_progress_lines(tmp_path):
    bad = tmp_path / "evil\x1b]0;x\x07\nname.safetensors"
    bad.write_bytes(b"not a capture")
    good = write_small(tmp_path / "good.safetensors")
    code, out, err = replay(str(good), str(bad))
    assert code == 2 and not RAW.search(out + err)
    lines = [ln for ln in error_lines(err) if ln.startswith("refmla: error:")]
    assert len(lines) == 1 and "evil\\x1b]0;x\\x07\\x0aname.safetensors" in lines[0]


def test_rids_are_escaped_in_the_diff_kv_table(tmp_path):
    def mutate(t, m):
        m["rids"] = ["r\x1b[1Aone\nfake row", "two\x07"]

    a = write_small(tmp_path / "a.safetensors", mutate)
    code, out, err = run_cli("diff-kv", str(a), str(a))
    assert code in (0, 1) and not RAW.search(out + err), out


# --- 3. nothing hides the rest ------------------------------------------------------------------


def test_a_lone_surrogate_costs_no_report(tmp_path):
    def mutate(t, m):
        m["backend"], m["rids"], m["sglang_version"] = "\ud800", ["\udfffa", "b"], "\ud800"

    paths = [str(write_small(tmp_path / f"{i}.safetensors", mutate if i == 0 else None)) for i in range(3)]
    code, out, err = replay(*paths)
    assert code == 0 and out.count("verdict  agree") == 3 and not RAW.search(out + err)
    code, out, _ = replay(*paths, "--json", "--jobs", "2")  # and across processes
    assert code == 0 and [r["verdict"] for r in json.loads(out)] == ["agree"] * 3


@pytest.mark.parametrize("depth", [33, 900, 100_000])
def test_deep_meta_is_one_line_naming_the_key(tmp_path, depth):
    from helpers import raw_write
    from hostile import small_capture

    t, m = small_capture()
    text = json.dumps(m)[:-1] + ', "deep": ' + "[" * depth + "]" * depth + "}"
    raw_write(tmp_path / "d.safetensors", t, text)
    good = write_small(tmp_path / "good.safetensors")
    for argv in ([str(tmp_path / "d.safetensors")], [str(tmp_path / "d.safetensors"), str(good), "--json"]):
        code, out, err = replay(*argv)
        lines = error_lines(err)
        assert code == 2 and len([ln for ln in lines if "error" in ln]) == 1, lines
        assert "deep" in lines[-1] or "meta" in lines[-1]
        if "--json" in argv:  # the whole array still comes out
            assert [r["verdict"] for r in json.loads(out)] == ["invalid", "agree"]


def test_depth_32_is_accepted(tmp_path):
    def mutate(t, m):
        v: list = []
        for _ in range(31):
            v = [v]
        m["nested"] = v

    code, out, _ = replay(str(write_small(tmp_path / "c.safetensors", mutate)), "--json")
    assert code == 0 and json.loads(out)["verdict"] == "agree"


@pytest.mark.parametrize("key", ["kv_pool_rows", "kv_pool_row_bytes", "mori_max_mr_bytes", "layer_id", "sm_scale"])
def test_integers_past_int64_are_refused_naming_the_key(tmp_path, key):
    def mutate(t, m):
        m.update(kv_pool_rows=4096, kv_pool_row_bytes=1152, kv_pool_layers_per_buffer=1)
        m[key] = 10**400

    path = write_small(tmp_path / "c.safetensors", mutate)
    for cmd in (["replay", "--backend", "reference"], ["inspect"]):
        code, out, err = run_cli(*cmd, str(path))
        lines = error_lines(err)
        assert code == 2 and len(lines) == 1 and f"meta key '{key}'" in lines[0], lines
        assert len(lines[0]) < 400  # the value is cut, not printed whole


def test_a_refused_plot_target_costs_no_report(tmp_path):
    pytest.importorskip("matplotlib")
    target = tmp_path / "plots"
    target.write_text("a file, not a folder")
    paths = [str(write_small(tmp_path / f"{i}.safetensors")) for i in range(2)]
    code, out, err = replay(*paths, "--plot", str(target))
    assert code == 2 and out.count("verdict  agree") == 2
    assert [ln for ln in error_lines(err) if ln.startswith("refmla: error:")][0].count("--plot") == 1


def test_a_failing_renderer_costs_only_its_own_report(tmp_path, monkeypatch):
    import refmla.render.replay as rr

    real = rr.render
    monkeypatch.setattr(rr, "render", lambda r: (_ for _ in ()).throw(ValueError("boom")) if "0." in r.capture else real(r))
    paths = [str(write_small(tmp_path / f"{i}.safetensors")) for i in range(2)]
    code, out, _ = replay(*paths)
    assert code == 0 and "could not be rendered: ValueError" in out and out.count("verdict  agree") == 2


# --- 4. no user file touched --------------------------------------------------------------------


@pytest.mark.parametrize("argv", [["golden", "generate", "--out", ""], ["golden", "generate", "--out", "  "],
                                  ["synth", ""], ["replay", "x.safetensors", "--plot", ""]])  # fmt: skip
def test_empty_output_paths_are_usage_errors(tmp_path, monkeypatch, argv):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "manifest.json").write_text('{"mine": 1}')
    code, _, err = run_cli(*argv)
    assert code == 2 and len(error_lines(err)) == 1 and "empty" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["manifest.json"]
    assert (tmp_path / "manifest.json").read_text() == '{"mine": 1}'


def test_a_foreign_manifest_is_never_replaced(tmp_path):
    (tmp_path / "manifest.json").write_text('{"mine": 1}')
    code, _, err = run_cli("golden", "generate", "--out", str(tmp_path))
    assert code == 2 and "not a golden manifest" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["manifest.json"]
    assert (tmp_path / "manifest.json").read_text() == '{"mine": 1}'


# --- 1. ranges and bounds -----------------------------------------------------------------------


def test_layer_ranges_are_never_expanded():
    from refmla.hook.config import HookConfig, parse_int_set

    ids = parse_int_set("0-1000000000000,7,5-9", "--layers")
    assert str(ids) == "0-1000000000000" and 10**12 in ids and 10**12 + 1 not in ids and len(ids) == 10**12 + 1
    assert str(parse_int_set("3,10-12,1", "x")) == "1,3,10-12" and parse_int_set("3,10-12", "x") == {3, 10, 11, 12}
    cfg = HookConfig(out_dir="/tmp/x", layers=ids)
    env = cfg.to_env()
    assert env["REFMLA_CAPTURE_LAYERS"] == "0-1000000000000"
    assert HookConfig.from_env(env).layers == ids
    with pytest.raises(ValueError, match="2\\*\\*63"):
        parse_int_set("0-99999999999999999999", "--layers")


def test_capture_run_hands_the_range_to_the_child(tmp_path):
    code, out, err = run_cli("capture", "run", "--layers", "0-4095", "--out", str(tmp_path / "c"), "--",
                             "sh", "-c", 'test "$REFMLA_CAPTURE_LAYERS" = 0-4095')  # fmt: skip
    assert code == 0, err  # (past a model's layers, 0-1000000000000, is a usage error: test_hostile_round3)
    code, _, err = run_cli("capture", "run", "--out", "", "--", "true")
    assert code == 2 and "empty" in err


def test_too_many_heads_are_refused_before_work(tmp_path):
    def mutate(t, m):
        t["q"] = t["q"][:, :1].expand(-1, 1025, -1).contiguous()

    code, _, err = replay(str(write_small(tmp_path / "c.safetensors", mutate)))
    assert code == 2 and "tensor 'q'" in err and "1024" in err


def test_the_interpreter_budget_skips_with_the_reason(tmp_path, monkeypatch):
    from refmla.backends import triton_interp
    from refmla.capture import read_capture

    cap = read_capture(write_small(tmp_path / "c.safetensors"))
    assert triton_interp.interpreter_work(cap) == 2 * (40 + 7)
    monkeypatch.setenv(triton_interp.BUDGET_ENV, "93")
    assert "94" in triton_interp.over_budget(cap) and "past its budget 93" in triton_interp.over_budget(cap)
    monkeypatch.setenv(triton_interp.BUDGET_ENV, "94")
    assert triton_interp.over_budget(cap) is None


# --- 6. duplicate rids --------------------------------------------------------------------------


def test_duplicate_rids_are_an_error_in_every_command(tmp_path):
    def mutate(t, m):
        m["rids"] = ["a", "a"]

    dup = write_small(tmp_path / "dup.safetensors", mutate)
    good = write_small(tmp_path / "good.safetensors")
    for argv in (["replay", "--backend", "reference", str(dup)], ["inspect", str(dup)],
                 ["diff-kv", str(good), str(dup)], ["diff-kv", str(dup), str(good)]):  # fmt: skip
        code, out, err = run_cli(*argv)
        assert code == 2 and "meta key 'rids'" in err and "repeats rids[0]" in err, (argv, err)


# --- 7. NaN / Inf inputs ------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["q_all", "q_one", "kv_row", "kv_inf"])
def test_nonfinite_inputs_are_a_finding_not_agreement(tmp_path, where):
    def mutate(t, m):
        if where.startswith("q"):
            q = t["q"].clone()
            if where == "q_all":
                q[:] = math.nan
            else:
                q[1, 1, 3] = math.inf
            t["q"] = q
        else:
            kv = t["kv_buffer"].clone()
            kv[int(t["kv_indices"][3])] = math.nan if where == "kv_row" else -math.inf
            t["kv_buffer"] = kv
        reference_out(t, m)  # production "agrees": NaN where the reference has NaN

    path = write_small(tmp_path / "c.safetensors", mutate)
    code, out, _ = replay(str(path), "--json")
    r = json.loads(out)
    assert code == 1 and r["verdict"] == "diverged" and r["diagnosis"] == "upstream_nonfinite"
    text = r["diagnosis_text"]
    assert "the input is already non-finite: the fault is upstream of attention" in text
    want = {"q_all": ["request 0", "request 1", "q (heads 0-1)"], "q_one": ["request 1", "q (heads 1)"],
            "kv_row": ["request 0", "kv_buffer (1 of 40"], "kv_inf": ["request 0", "kv_buffer"]}[where]  # fmt: skip
    assert all(w in text for w in want), text
    code, out, _ = replay(str(path))
    assert code == 1 and "verdict  diverged" in out and "upstream_nonfinite" in out


def test_nonfinite_lse_follows_the_output_rule(tmp_path):
    """NaN vs NaN and -inf vs -inf are judged alike (agreeing values) in the output, the lse and
    the split lse; a NaN against a finite value fails in each."""
    from refmla.compare import same_nonfinite

    nan, inf = math.nan, math.inf
    a = torch.tensor([nan, -inf, inf, 1.0, nan, -inf])
    e = torch.tensor([nan, -inf, inf, 1.0, 1.0, inf])
    assert same_nonfinite(a, e).tolist() == [True, True, True, False, False, False]

    def mutate(t, m):
        t["q"] = torch.full_like(t["q"], nan)
        reference_out(t, m)

    code, out, _ = replay(str(write_small(tmp_path / "c.safetensors", mutate)), "--json")
    observed = json.loads(out)["backends"]["observed"]
    assert observed["lse"]["status"] == "pass"  # NaN vs NaN lse: like the output's NaN vs NaN
    assert code == 1  # and the capture is still a finding (upstream_nonfinite), never agree


def test_disagg_reports_the_rest_and_names_duplicate_rids_and_huge_ints(tmp_path):
    """A repeated rid (one decode capture) and a 400-digit pool key (one prefill capture): each is
    one line naming the key, exit 2, and the disagg report of everything else is still printed."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    assert run_cli("synth-disagg", str(tmp_path / "d"))[0] == 0

    def rewrite(path, edit):
        with safe_open(str(path), "pt") as f:
            header, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
        meta = json.loads(header["meta"])
        edit(meta)
        save_file(tensors, str(path), {**header, "meta": json.dumps(meta)})

    decode = sorted((tmp_path / "d" / "decode").glob("*.safetensors"))
    prefill = sorted((tmp_path / "d" / "prefill").glob("*.safetensors"))
    rewrite(decode[0], lambda m: m.update(rids=[m["rids"][0]] * len(m["rids"])))
    rewrite(prefill[0], lambda m: m.update(kv_pool_rows=10**400))
    code, out, err = run_cli("disagg", str(tmp_path / "d" / "prefill"), str(tmp_path / "d" / "decode"),
                             "--backend", "reference", "--no-explain")  # fmt: skip
    errors = [ln for ln in error_lines(err) if ln.startswith("refmla: error:")]
    assert code == 2 and len(errors) == 2, errors
    assert any("meta key 'rids'" in ln for ln in errors) and any("meta key 'kv_pool_rows'" in ln for ln in errors)
    assert "verdict" in out and out.count("invalid  ") == 2


class Unpicklable:
    def __reduce__(self):
        raise TypeError("this report cannot be pickled")


def report_or_unpicklable(path, opts):
    """A --jobs task whose result for one capture cannot travel back from the worker."""
    from refmla.batch import replay_one

    return Unpicklable() if "bad" in str(path) else replay_one(path, opts)


def test_a_report_that_cannot_come_back_costs_only_its_capture(tmp_path):
    from refmla.batch import replay_many
    from refmla.context import ReplayOptions

    paths = [str(write_small(tmp_path / f"{name}.safetensors")) for name in ("a", "bad", "c")]
    reports = replay_many(paths, ReplayOptions(backends=["reference"], explain=False), jobs=2,
                          task=report_or_unpicklable)  # fmt: skip
    assert [r.verdict for r in reports] == ["agree", "invalid", "agree"]
    assert "cannot be pickled" in reports[1].error and reports[1].capture == paths[1]
