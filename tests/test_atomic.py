"""Issue 12, writes: refmla.atomic and every writer that uses it (capture, synth, golden, plots)."""

import json
import os
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from hostile import error_lines, run_cli
from refmla.atomic import TMP_MARK, WriteError, sweep, temp_name, write_bytes

ROOT = Path(__file__).resolve().parents[1]


def _special(kind: str, path: Path) -> Path:
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dir":
        path.mkdir()
    elif kind == "symlink":
        (path.parent / "real").write_bytes(b"keep")
        path.symlink_to(path.parent / "real")
    elif kind == "device":  # a copy of /dev/full's node, in tmp: never the real one
        try:
            os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 7))
        except PermissionError:
            pytest.skip("creating a device node needs root")
    return path


@pytest.mark.parametrize("kind", ["fifo", "dir", "symlink", "device"])
def test_anything_but_a_regular_file_is_refused_not_replaced(tmp_path, kind):
    target = _special(kind, tmp_path / "target.safetensors")
    before = os.lstat(target)
    code, out, err = run_cli("synth", str(target), "--preset", "hostile")
    assert code == 2 and len(error_lines(err)) == 1 and str(target) in err and "refusing" in err
    after = os.lstat(target)
    assert (after.st_mode, after.st_ino) == (before.st_mode, before.st_ino)
    assert [p.name for p in tmp_path.iterdir() if TMP_MARK in p.name] == []


@pytest.mark.parametrize("mask", [0o022, 0o077, 0o002])
def test_mode_follows_the_umask(tmp_path, mask):
    old = os.umask(mask)
    try:
        p = write_bytes(tmp_path / "f.bin", b"x")
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(p).st_mode) == 0o666 & ~mask


def test_replacing_a_regular_file_keeps_no_temp(tmp_path):
    p = tmp_path / "f.json"
    p.write_bytes(b'{"format": "refmla.old/1"}')  # a file refmla wrote (its marker): replaced
    write_bytes(p, [b"ne", memoryview(b"w")])
    assert p.read_bytes() == b"new" and sorted(x.name for x in tmp_path.iterdir()) == ["f.json"]


def test_a_dead_writers_temp_file_is_swept_by_the_next_write(tmp_path):
    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = int(child.stdout)
    stale = temp_name(tmp_path / "a.safetensors", dead)
    stale.write_bytes(b"half")
    mine = temp_name(tmp_path / "b.safetensors", os.getpid())  # a live writer's: kept
    mine.write_bytes(b"busy")
    write_bytes(tmp_path / "c.bin", b"x")
    assert not stale.exists() and mine.exists()
    assert sweep(tmp_path) == []


@pytest.mark.parametrize("how", ["anonymous", "named"])
def test_a_writer_killed_mid_write_leaves_nothing(tmp_path, how):
    """SIGKILL while the bytes are being written: no file under the name, nothing else either
    (O_TMPFILE), or a temp name the next write sweeps (filesystems without it)."""
    script = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(ROOT)!r})
        import refmla.atomic as a
        if {how!r} == "named":
            a._open_anonymous = lambda folder: None
        def chunks():
            yield b"x" * (1 << 20)
            print("writing", flush=True)
            time.sleep(60)
            yield b"y"
        a.write_bytes({str(tmp_path / "big.safetensors")!r}, chunks())
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "writing"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    left = sorted(p.name for p in tmp_path.iterdir())
    assert "big.safetensors" not in left
    if how == "anonymous":
        assert left == []
    write_bytes(tmp_path / "next.bin", b"x")  # the next write to the folder sweeps a dead writer's temp
    assert sorted(p.name for p in tmp_path.iterdir()) == ["next.bin"]


def test_write_failures_are_one_line_naming_the_path(tmp_path):
    (tmp_path / "file").write_bytes(b"")
    target = tmp_path / "file" / "cap.safetensors"  # a file as the parent
    code, out, err = run_cli("synth", str(target))
    assert code == 2 and len(error_lines(err)) == 1 and str(target) in err and "not a directory" in err
    with pytest.raises(WriteError, match="not a directory"):
        write_bytes(target, b"x")
    code, out, err = run_cli("golden", "generate", "--out", str(tmp_path / "file"))
    assert code == 2 and len(error_lines(err)) == 1 and str(tmp_path / "file") in err


def test_golden_generate_writes_the_manifest_last(tmp_path, monkeypatch):
    """A generate that dies part way leaves the manifest as it was before (issue 33): the previous
    run's manifest restored, none where there was none; a completed generate writes it last."""
    import refmla.golden.build as build
    from refmla.golden import load_manifest

    out = tmp_path / "g"
    out.mkdir()
    previous = json.dumps({"format": "refmla.golden.manifest/1", "cases": []})  # a previous run's
    (out / build.MANIFEST).write_text(previous)
    calls = []

    def dies_on_the_second(case, out_dir):
        calls.append(case.name)
        if len(calls) == 2:
            raise KeyboardInterrupt  # killed
        return {"name": case.name}

    monkeypatch.setattr(build, "write_case", dies_on_the_second)
    with pytest.raises(KeyboardInterrupt):
        build.generate(out, suite="quick")
    assert (out / build.MANIFEST).read_text() == previous
    fresh = tmp_path / "fresh"
    calls.clear()
    with pytest.raises(KeyboardInterrupt):
        build.generate(fresh, suite="quick")
    assert not (fresh / build.MANIFEST).exists()
    with pytest.raises(FileNotFoundError, match="incomplete"):
        load_manifest(fresh)
