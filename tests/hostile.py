"""Builders for hostile-input tests: a small valid capture as tensors + meta, and the CLI run in-process."""

from __future__ import annotations

import contextlib
import io
import signal
from typing import Optional

import torch

from helpers import raw_write
from refmla.synthetic import SynthSpec, faulty_output, make_inputs, make_meta

SMALL = SynthSpec(name="small", num_heads=2, seq_lens=(40, 7), max_kv_splits=4, num_kv_splits=(2, 1), free_pages=1)


def small_capture(spec: SynthSpec = SMALL) -> tuple[dict, dict]:
    """(tensors, meta) of a small clean decode capture whose `out` a correct kernel would write."""
    t = make_inputs(spec)
    t["out"], _ = faulty_output(spec, t, "none")
    return t, make_meta(spec)


def write_small(path, mutate=None, spec: SynthSpec = SMALL):
    """A small capture written without validation, after ``mutate(tensors, meta)``."""
    t, m = small_capture(spec)
    if mutate is not None:
        mutate(t, m)
    raw_write(path, t, m)
    return path


def reference_out(t: dict, m: dict) -> None:
    """``out`` and ``lse`` as the fp64 reference computes them on the (mutated) inputs: what a
    kernel that "agrees" with the reference writes, NaN for NaN (issue 22's non-finite inputs)."""
    from refmla import reference as ref
    from refmla.attended import Attended
    from refmla.scales import Scales

    sc = Scales(512, m["sm_scale"], m["logit_cap"], m["k_scale"], m["v_scale"])
    out, lse = ref.mla_decode_ref(t["q"], t["kv_buffer"], Attended.from_tensors(t), sc)
    t["out"], t["lse"] = out.to(t["out"].dtype), lse.float()


def run_cli(*argv: str, stdin: Optional[str] = None) -> tuple[int, str, str]:
    """refmla's main in-process: (exit code, stdout, stderr); SystemExit (argparse) becomes its code."""
    from refmla.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(argv))
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 2
    return code, out.getvalue(), err.getvalue()


def default_signals() -> None:
    """``preexec_fn`` of a child a test signals: SIGINT / SIGTERM at their defaults and unblocked,
    whatever the test runner inherited (a shell's background job starts with SIGINT ignored)."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, (signal.SIGINT, signal.SIGTERM))


def ignored_sigint() -> None:
    """``preexec_fn`` of a child started the way a shell starts a background job: SIGINT ignored."""
    default_signals()
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def error_lines(err: str) -> list[str]:
    return [ln for ln in err.splitlines() if ln.strip()]


def set_tensor(name: str, value: torch.Tensor):
    def mutate(t, m):
        t[name] = value

    return mutate


__all__ = ["SMALL", "default_signals", "error_lines", "ignored_sigint", "reference_out", "run_cli", "set_tensor", "small_capture", "write_small"]
