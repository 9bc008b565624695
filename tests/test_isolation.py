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
from refmla.pipeline import replay_capture
from refmla.synthetic import preset, synth_capture


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


def test_a_spawned_child_past_its_deadline_is_killed(monkeypatch):
    """On a GPU (spawned children) a run given a deadline (``retry=False``: the sweep's budget) is
    killed there: KernelTimeout, in about the deadline, not the 60 s the child would take."""
    import time

    monkeypatch.setattr(isolation, "cuda_in_play", lambda: True)
    t0 = time.monotonic()
    with pytest.raises(isolation.KernelTimeout, match="still running after 3 s"):
        isolation.run_isolated(time.sleep, 60, wall_s=3, retry=False)
    assert time.monotonic() - t0 < 30


def _deadlock_after_fork():
    """A lock held by another thread of this process at the fork: the child waits on it forever."""
    import threading
    import time

    lock, held = threading.Lock(), threading.Event()

    def holder():
        with lock:
            held.set()
            time.sleep(30)

    threading.Thread(target=holder, daemon=True).start()
    held.wait()
    return lambda: lock.acquire()  # runs in the child: the holder thread is not there to release it


def test_a_child_deadlocked_on_an_inherited_lock_is_an_error_not_a_hang(monkeypatch):
    import time

    monkeypatch.setenv(isolation.STALL_ENV, "1")
    fn = _deadlock_after_fork()
    t0 = time.monotonic()
    with pytest.raises(isolation.KernelCrashed, match="^made no progress for 1 s .*REFMLA_ISOLATE=0"):
        isolation.run_isolated(fn)
    assert time.monotonic() - t0 < 10  # killed by the watchdog, not after the holder's 30 s


def _busy(seconds: float) -> int:
    import time

    t0, n = time.process_time(), 0
    while time.process_time() - t0 < seconds:
        n += 1
    return n


def test_a_child_that_computes_longer_than_the_stall_limit_is_kept(monkeypatch):
    monkeypatch.setenv(isolation.STALL_ENV, "0.5")
    assert isolation.run_isolated(_busy, 1.5) > 0  # CPU used all along: progress, never killed


def test_a_child_that_spins_past_its_wall_time_is_an_error_not_a_hang(monkeypatch):
    """A spin lock held at the fork (MKL's allocator, seen in a sweep's forked child) uses CPU and
    never replies: the CPU watchdog cannot see it, the wall-time limit does."""
    import time

    monkeypatch.setenv(isolation.STALL_ENV, "0.5")
    t0 = time.monotonic()
    with pytest.raises(isolation.KernelCrashed, match="^still running after 1 s of wall time .*REFMLA_ISOLATE=0"):
        isolation.run_isolated(_busy, 60.0, wall_s=1.0)
    assert time.monotonic() - t0 < 10  # killed at its limit (twice: once more in a fresh child), not after 60 s
    assert isolation.run_isolated(_busy, 0.2, wall_s=30.0) > 0  # within its limit: its result


def _spins_in_the_first_child(marker: str) -> int:
    """Spins (a lock inherited at the fork) unless an earlier child left ``marker``: then returns."""
    if os.path.exists(marker):
        return 7
    open(marker, "w").close()
    return _busy(60.0)


def test_a_run_killed_at_its_wall_time_is_tried_once_more_in_a_fresh_child(tmp_path):
    assert isolation.run_isolated(_spins_in_the_first_child, str(tmp_path / "m"), wall_s=1.0) == 7


def test_the_sweep_gives_its_kernel_runs_a_wall_time_limit():
    from refmla.sweep import SweepConfig
    from refmla.sweep.run import KERNEL_S_FLOOR

    assert SweepConfig(budget=8).options().kernel_seconds == KERNEL_S_FLOOR
    assert SweepConfig(budget=3000).options().kernel_seconds == 600  # a fifth of a long budget
    assert ReplayOptions().kernel_seconds is None  # a replay waits for its kernels as before


def test_a_deadlocked_kernel_is_that_backends_error_and_the_others_are_kept(hostile, monkeypatch):
    """A kernel backend whose child blocks on a lock held at the fork: ``error`` naming the stall,
    the triton backend after it and the observed output kept, exit 1 (not a hang)."""
    import refmla.backends as backends
    import refmla.pipeline as replay
    from refmla.backends.triton import TritonBackend

    monkeypatch.setenv(isolation.STALL_ENV, "1")
    stuck = _deadlock_after_fork()

    class Stuck(TritonBackend):
        name = "triton_stuck"

        def run(self, cap, opts):
            stuck()
            return super().run(cap, opts)

    monkeypatch.setitem(backends._CACHE, Stuck.name, Stuck())
    monkeypatch.setitem(backends._WHERE, Stuck.name, "tests/test_isolation.py")
    monkeypatch.setattr(replay, "ALL_NAMES", tuple(replay.ALL_NAMES) + (Stuck.name,))
    report = replay_capture(read_capture(hostile), ReplayOptions(backends=[Stuck.name, "triton"]))
    entry = report.backends[Stuck.name]
    assert entry.status == "error" and entry.reason.startswith("made no progress for 1 s"), entry.reason
    assert report.backends["triton"].status == "pass" and report.backends["observed"].status == "pass"
    assert report.exit_code == 1 and report.diagnosis == "backend_error"


def test_a_replay_given_a_wall_time_limit_kills_a_kernel_that_spins(hostile, monkeypatch):
    """``ReplayOptions.kernel_seconds`` holds for a replay as for the sweep (whose findings are
    replayed with it): a kernel that spins is that backend's ``error``, the others are kept."""
    import refmla.backends as backends
    import refmla.pipeline as replay
    from refmla.backends.triton import TritonBackend

    monkeypatch.setenv(isolation.STALL_ENV, "0.5")  # the CPU watchdog cannot see a spin

    class Spins(TritonBackend):
        name = "triton_spins"

        def run(self, cap, opts):
            _busy(60.0)
            return super().run(cap, opts)

    monkeypatch.setitem(backends._CACHE, Spins.name, Spins())
    monkeypatch.setitem(backends._WHERE, Spins.name, "tests/test_isolation.py")
    monkeypatch.setattr(replay, "ALL_NAMES", tuple(replay.ALL_NAMES) + (Spins.name,))
    report = replay_capture(read_capture(hostile), ReplayOptions(backends=[Spins.name, "triton"], kernel_seconds=1.0))
    entry = report.backends[Spins.name]
    assert entry.status == "error" and entry.reason.startswith("still running after 1 s of wall time"), entry.reason
    assert report.backends["triton"].status == "pass" and report.exit_code == 1
