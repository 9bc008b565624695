"""A kernel that crashes is a finding (docs/contract.md section 3): each kernel backend runs in a child
process (refmla.isolation), so a segfault is that backend's ``error`` and every other result is kept."""

from __future__ import annotations

import ctypes
import os
import signal

import pytest

import planted_sglang
from refmla import batch, isolation
from refmla.backends.base import BackendUnavailable
from refmla.capture import read_capture
from refmla.context import ReplayOptions
from refmla.replay import replay_capture
from refmla.synth import preset, synth_capture


def _segfault():
    ctypes.string_at(0)  # a read of address 0: SIGSEGV


def _raise():
    raise ValueError("bad shape")


def _unavailable():
    raise BackendUnavailable("no GPU here")


def test_a_child_killed_by_a_signal_is_named():
    with pytest.raises(isolation.KernelCrashed, match="^killed by SIGSEGV: out-of-bounds read\\?$"):
        isolation.run_isolated(_segfault)
    with pytest.raises(isolation.KernelCrashed, match="^killed by SIGABRT"):
        isolation.run_isolated(os.abort)


def test_a_child_returns_values_and_exceptions_as_in_process():
    import torch

    t = torch.arange(12.0).reshape(3, 4)[:, 1:]  # a non-contiguous view
    got = isolation.run_isolated(lambda x: {"out": x * 2}, t)
    assert torch.equal(got["out"], t * 2)
    with pytest.raises(isolation.KernelError, match="^ValueError: bad shape$"):
        isolation.run_isolated(_raise)
    with pytest.raises(BackendUnavailable, match="no GPU here"):
        isolation.run_isolated(_unavailable)


def test_crash_text_of_every_wait_status():
    assert isolation.crash_text(signal.SIGBUS) == "killed by SIGBUS: misaligned or out-of-bounds access?"
    assert isolation.crash_text(3 << 8) == "the kernel's process exited with status 3 without a result"


@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    path = tmp_path_factory.mktemp("iso") / "hostile.safetensors"
    synth_capture(path, preset("hostile"), "none")
    return path


def test_sglang_kernel_reading_out_of_bounds_is_an_error_and_the_others_are_kept(hostile, monkeypatch):
    """SGLang's Triton kernel with its slot pointer planted far off segfaults in the interpreter."""
    (name,) = planted_sglang.register(monkeypatch, "oob_index")
    report = replay_capture(read_capture(hostile), ReplayOptions(backends=["triton", name]))
    crashed = report.backends[name]
    assert crashed.status == "error" and crashed.reason == "killed by SIGSEGV: out-of-bounds read?"
    assert report.backends["triton"].status == "pass"  # ran after the crash, in a clean process
    assert report.backends["observed"].status == "pass" and report.verdict == "diverged"
    assert report.exit_code == 1 and report.diagnosis == "backend_error"


def test_jobs_report_the_crash_not_an_invalid_capture(hostile, tmp_path):
    other = tmp_path / "clean.safetensors"
    synth_capture(other, preset("hostile", seed=3), "none")
    opts = ReplayOptions(backends=["triton_oob_index"], explain=False)
    reports = batch.replay_many([str(hostile), str(other)], opts, jobs=2, task=planted_sglang.replay_with_plants)
    for r in reports:
        assert r.verdict == "diverged" and r.exit_code == 1, r.error
        assert r.backends["triton_oob_index"].reason == "killed by SIGSEGV: out-of-bounds read?"
        assert r.backends["observed"].status == "pass"


def _double(x):
    return x * 2


def test_the_spawned_child_used_when_cuda_is_in_play(monkeypatch):
    """What a GPU replay does (CUDA cannot be used in a forked child): a fresh interpreter per run."""
    monkeypatch.setattr(isolation, "cuda_in_play", lambda: True)
    assert isolation.run_isolated(_double, 21) == 42
    with pytest.raises(isolation.KernelCrashed, match="^killed by SIGSEGV"):
        isolation.run_isolated(_segfault)
    with pytest.raises(isolation.KernelError, match="^ValueError: bad shape$"):
        isolation.run_isolated(_raise)
