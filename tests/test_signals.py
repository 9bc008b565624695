"""Issue 22: SIGINT and SIGTERM sent to a real `refmla replay --jobs 2 --json` subprocess.

It must exit promptly with the conventional status (130 / 143), stop its worker processes (and,
after them, the resource tracker: the whole session empties), leave no temp file, and never leave
on stdout a document that parses as complete when the run was cut.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hostile import default_signals, ignored_sigint, write_small

ROOT = Path(__file__).resolve().parents[1]
EXIT_SECONDS = 30.0  # from the signal to the exit, on a loaded 2-core machine (measured ~2.5 s)
GRACE_SECONDS = 10.0  # for the session to empty after the exit (the resource tracker: ~1.5 s)


def session_members(sid: int) -> list[int]:
    """Processes whose session id is ``sid`` (from /proc: field 6 of stat)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid:
            found.append(int(stat.parent.name))
    return found


def wait_for(pred, seconds: float) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.1)
    return pred()


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc to find the child processes")
@pytest.mark.parametrize("sig,status", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_ends_a_parallel_replay_cleanly(tmp_path, sig, status):
    capture = write_small(tmp_path / "c.safetensors")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = dict(os.environ, PYTHONPATH=str(ROOT), TRITON_INTERPRET="1", TMPDIR=str(tmp))
    argv = [sys.executable, "-m", "refmla", "replay", "--jobs", "2", "--json", *[str(capture)] * 32]
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                            preexec_fn=default_signals)  # not whatever the runner inherited
    try:
        assert wait_for(lambda: len(session_members(proc.pid)) >= 3, 120), "the workers never started"
        time.sleep(2.0)  # the workers are replaying
        t0 = time.monotonic()
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=EXIT_SECONDS)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == status, err.decode()[-2000:]
    assert took < EXIT_SECONDS
    assert wait_for(lambda: not session_members(proc.pid), GRACE_SECONDS), f"left running: {session_members(proc.pid)}"
    assert list(tmp.iterdir()) == [], "temp files left"
    assert b"Traceback" not in err, err.decode()[-2000:]
    if out.strip():  # whatever came out before the signal is not a complete-looking document
        with pytest.raises(ValueError):
            json.loads(out)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc to find the child processes")
def test_a_replay_started_with_sigint_ignored_honours_it(tmp_path):
    """Started as a shell starts a background job (SIGINT ignored), refmla keeps it ignored, as Unix
    tools do: a SIGINT changes nothing, the run completes with its whole document; SIGTERM still ends it."""
    capture = write_small(tmp_path / "c.safetensors")
    env = dict(os.environ, PYTHONPATH=str(ROOT), TRITON_INTERPRET="1")
    argv = [sys.executable, "-m", "refmla", "replay", "--jobs", "2", "--json", *[str(capture)] * 6]
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                            preexec_fn=ignored_sigint)
    try:
        assert wait_for(lambda: len(session_members(proc.pid)) >= 3, 120), "the workers never started"
        os.killpg(proc.pid, signal.SIGINT)  # the whole group, as a terminal's Ctrl-C would
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, err.decode()[-2000:]
    assert [r["verdict"] for r in json.loads(out)] == ["agree"] * 6
