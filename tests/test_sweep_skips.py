"""A sweep that did not run a kernel is not a pass: a backend named with --backend that does not
run on a layout it reads makes `refmla sweep` exit 3 (as `refmla replay` does) unless
--allow-skip; and a kernel hidden behind a plain ``def f(*args, **kwargs)`` wrapper (a profiler's,
a monkeypatch's, no functools.wraps) is called by its engine's documented parameter order where
the adapter knows it (SGLang's decode kernel), or refused in one line where it does not."""

from __future__ import annotations

import inspect
import json

import pytest

import refmla.backends as backends
from refmla.backends import triton as tb
from refmla.backends import vllm_triton as vt
from refmla.backends.base import Backend, BackendUnavailable
from refmla.backends.calling import KernelSignatureError, kwargs_for, unreadable_signature
from refmla.capture import write_capture
from refmla.cli import main
from refmla.sweep import SweepConfig, run_sweep
from refmla.sweep.cases import capture_meta, capture_of, case_of

pytestmark = [pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:divide by zero encountered:RuntimeWarning")]
SPACE = ["heads=16", "batch=1", "length=page+1", "page=16", "splits=2", "cap=0", "table=shuffled", "null=nan"]
SMALL = [a for item in SPACE for a in ("--space", item)]


def plain_wrapper(fn):
    """What a profiler or a monkeypatch does: a wrapper that hides the kernel's signature."""
    calls = []

    def wrapper(*args, **kwargs):
        calls.append(len(args))
        return fn(*args, **kwargs)

    wrapper.calls = calls
    return wrapper


def _sweep(argv, capsys) -> tuple[int, dict, str]:
    rc = main(["sweep", "--json", "--repeat", "2", "--max-shrink", "0", *argv])
    out = capsys.readouterr()
    return rc, json.loads(out.out), out.err


def test_the_documented_order_is_sglangs_signature():
    """The order the adapter calls a hidden kernel by is the installed kernel's own parameter order."""
    ok, why = backends.get_backend("triton").availability()
    if not ok:
        pytest.skip(f"SGLang's Triton kernel unavailable: {why}")
    real, _, _ = tb.locate_decode_kernel()
    assert list(inspect.signature(real).parameters)[: len(tb.DOCUMENTED_ORDER)] == list(tb.DOCUMENTED_ORDER)
    assert unreadable_signature(real) is None and "wrapper" in unreadable_signature(plain_wrapper(real))


def test_a_wrapped_sglang_kernel_is_swept_and_replayed(tmp_path, monkeypatch, capsys):
    """SGLang's decode kernel behind a plain wrapper: the sweep runs it on decode and block_table
    (fp8 with k_scale != 1 included) and replay runs it too, positionally, in the documented order."""
    ok, why = backends.get_backend("triton").availability()
    if not ok:
        pytest.skip(f"SGLang's Triton kernel unavailable: {why}")
    real, module, version = tb.locate_decode_kernel()
    wrapped = plain_wrapper(real)
    monkeypatch.setattr(tb, "_located", (wrapped, module, version))
    rep = run_sweep(SweepConfig(backends=["triton"], budget=600, out=str(tmp_path), max_cases=2, repeat=2,
                                layouts=["decode", "block_table"], space=[*SPACE, "kv=float8_e4m3fn"],
                                checks=["reference"]))  # fmt: skip
    assert rep.exit_code == 0 and rep.not_run == [], rep.not_run
    per_layout = {c.layout: c.outcomes["triton"]["reference"].status for c in rep.cases}
    assert per_layout == {"decode": "pass", "block_table": "pass"}, [c.outcomes for c in rep.cases]
    assert wrapped.calls and set(wrapped.calls) == {len(tb.DOCUMENTED_ORDER)}  # positional, every documented one
    point = {"heads": 16, "page": 16, "length": "page+1", "batch": 2, "splits": "2", "kv": "float8_e4m3fn", "cap": 0.0}
    case = case_of("decode", point, seed=0, index=0)
    path = tmp_path / "decode.safetensors"
    write_capture(path, capture_of(case).tensors(), capture_meta(case), compact=False)
    capsys.readouterr()
    assert main(["replay", str(path), "--backend", "triton", "--json"]) == 0
    entry = json.loads(capsys.readouterr().out)["backends"]["triton"]
    assert entry["status"] == "pass" and any("documented parameter order" in n for n in entry["info"]["notes"])


def test_a_wrapped_kernel_without_a_known_order_is_refused_in_one_line_and_exits_3(tmp_path, monkeypatch, capsys):
    """vLLM's kernel behind a plain wrapper: refmla knows no documented order for it, so it says so
    in one line and does not call it; the sweep that asked for it exits 3, or 0 with --allow-skip."""
    ok, why = backends.get_backend("vllm_triton").availability()
    if not ok:
        pytest.skip(f"vLLM's Triton kernel unavailable: {why}")
    real, module, version = vt.locate_vllm_kernel()
    wrapped = plain_wrapper(real)
    monkeypatch.setattr(vt, "locate_vllm_kernel", lambda: (wrapped, module, version))
    with pytest.raises(KernelSignatureError, match="cannot tell which argument goes where") as e:
        kwargs_for(wrapped, {"q": 1})
    assert "\n" not in str(e.value)
    argv = ["--backend", "vllm_triton", "--layout", "block_table", "--budget", "600", "--out", str(tmp_path), *SMALL,
            "--space", "kv=bfloat16", "--check", "reference"]  # fmt: skip
    rc, rep, err = _sweep(argv, capsys)
    assert rc == 3 and not wrapped.calls, rep["backends"]["vllm_triton"]
    (unrun,) = rep["not_run"]
    assert unrun["backend"] == "vllm_triton" and unrun["layout"] == "block_table" and "functools.wraps" in unrun["why"]
    lines = [line for line in err.splitlines() if line.startswith("refmla:")]  # (the others: progress)
    assert len(lines) == 1 and "vllm_triton was asked for and did not run on block_table" in lines[0], err
    rc, rep, err = _sweep([*argv, "--allow-skip"], capsys)
    assert rc == 0 and rep["exit_code"] == 0 and rep["not_run"] and "refmla:" not in err


class Unavailable(Backend):
    name = "never_here"

    def availability(self):
        return False, "not installed (a test stand-in)"

    def run(self, cap, opts):
        raise BackendUnavailable("not installed (a test stand-in)")


def test_a_named_backend_that_is_unavailable_exits_3_and_layouts_it_does_not_read_do_not_count(tmp_path, monkeypatch,
                                                                                                capsys):
    monkeypatch.setitem(backends._CACHE, Unavailable.name, Unavailable())
    monkeypatch.setitem(backends._WHERE, Unavailable.name, "test_sweep_skips:Unavailable")
    rep = run_sweep(SweepConfig(backends=[Unavailable.name], budget=5, out=str(tmp_path), layouts=["decode", "sparse"]))
    assert rep.exit_code == 3 and [(n, la) for n, la, _ in rep.not_run] == [(Unavailable.name, "decode")]
    # the reference reads every layout and runs on each: nothing unrun; SGLang's decode kernel does not read verify
    rep = run_sweep(SweepConfig(backends=["reference"], budget=1, out=str(tmp_path), layouts=["decode", "verify"],
                                space=["heads=4", "batch=1", "length=1"], max_cases=2))  # fmt: skip
    assert rep.exit_code == 0 and rep.not_run == []
    from refmla.sweep.kernels import not_read

    assert "reads no verify capture" in not_read("triton", "verify") and not_read("triton", "block_table") is None
    defaults = run_sweep(SweepConfig(backends=[Unavailable.name], budget=1, out=str(tmp_path), layouts=["decode"],
                                     per_layout={"decode": (Unavailable.name,)}))  # fmt: skip
    assert defaults.exit_code == 0 and defaults.not_run == []  # the default set: skipping stays quiet, as replay's
