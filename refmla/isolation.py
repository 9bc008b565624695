"""A kernel backend run where its crash cannot take the replay down (docs/contract.md section 3).

A kernel that reads out of bounds kills the process it runs in (the Triton interpreter and a
CPU kernel: SIGSEGV / SIGBUS) or, on a GPU, poisons the CUDA context for every kernel after it
(an illegal memory access is sticky). So each kernel backend runs in a child process and returns
its :class:`~refmla.backends.base.BackendResult` through a pipe; the reference and the observed
output stay in the replay's own process. A child that dies by a signal becomes :class:`KernelCrashed`
("killed by SIGSEGV: out-of-bounds read?"), which the replay reports as that backend's ``error``
while every other backend's result is kept.

How the child is made:

    fork   (CPU: CUDA is neither initialized nor available here) the child inherits the capture,
           the imported kernels and any backend registered in this process, so the cost is one
           fork (copy-on-write) plus the result's bytes through the pipe. The child runs torch
           with one thread: libgomp's thread team is not fork-safe (a child using the parent's
           team waits forever on its barrier), and a kernel's own work is its kernel's, not
           torch's;
    spawn  (a CUDA device is present: CUDA cannot be used in a child forked after it was
           initialized, and torch initializes it lazily in ways a replay cannot rule out) a fresh
           interpreter that receives the backend, the capture and the options pickled through the
           pipe. It costs an interpreter start and the imports per kernel run (seconds), which a
           GPU replay pays for a context no fault of one kernel can poison.

A forked child inherits every lock of the parent in the state it was in at the fork; one held
then by another of the parent's threads is never released in the child (a long-lived, threaded
process: a test runner, a server). A watchdog turns such a child into a finding instead of a
hang: a forked child that neither replies nor uses any CPU time for ``REFMLA_STALL_S`` seconds
(default 60; read from /proc) is killed and reported as KernelCrashed ("made no progress for
60 s ..."), the backend's ``error``, every other backend's result kept. A child that spins instead
(a spin lock held at the fork: MKL's allocator, seen in a sweep's forked child) uses CPU and never
replies; ``run_isolated(..., wall_s=N)`` kills it after N seconds of wall time and runs it once more
in a fresh child (an inherited lock is the fork's doing, not the kernel's): a second timeout is
the backend's ``error`` (the sweep sets N: ``ReplayOptions.kernel_seconds``).

``REFMLA_ISOLATE=0`` (or ``ReplayOptions.isolate = False``) runs backends in-process (a debugger
wants that); then a crashing kernel takes the process down, as it would without refmla.
"""

from __future__ import annotations

import faulthandler
import io
import multiprocessing as mp
import os
import pickle
import select
import signal
import struct
import sys
import time
from typing import Any, Callable

import torch

from refmla.backends.base import BackendUnavailable
from refmla.kernel import InterfaceError
from refmla.util import error_text

ENV = "REFMLA_ISOLATE"
STALL_ENV = "REFMLA_STALL_S"
DEFAULT_STALL_S = 60.0
WATCH_S = 0.25  # how often the parent looks at a silent child's CPU time
WALL_TEXT = ("still running after {s:g} s of wall time with no reply: a kernel that does not return (a spin "
             "lock held at the fork, an endless loop); rerun with REFMLA_ISOLATE=0 to run it in-process")
STALL_TEXT = ("made no progress for {s:g} s (no CPU used, no reply): a deadlock, e.g. on a lock a thread of "
              "the replay's process held at the fork; rerun with REFMLA_ISOLATE=0 to run it in-process")

# What a signal most likely means for a kernel, said with the signal's name.
_LIKELY = {
    "SIGSEGV": "out-of-bounds read?",
    "SIGBUS": "misaligned or out-of-bounds access?",
    "SIGFPE": "integer division by zero?",
    "SIGILL": "an instruction this CPU lacks?",
    "SIGABRT": "an assertion in native code",
    "SIGKILL": "out of memory?",
}


class KernelCrashed(Exception):
    """The child running a kernel died without a result (a signal, or an exit before replying)."""

    def __str__(self) -> str:  # error_text() prints "KernelCrashed: killed by SIGSEGV: ..."
        return str(self.args[0])


class KernelTimeout(KernelCrashed):
    """The forked child was still running after its wall-time limit (one that spins): killed."""


class KernelError(Exception):
    """The kernel raised in the child: the message is the child's error_text (type and first line)."""

    def __str__(self) -> str:
        return str(self.args[0])


def crash_text(status: int) -> str:
    """One line for a child's wait status: "killed by SIGSEGV: out-of-bounds read?"."""
    if os.WIFSIGNALED(status):
        try:
            name = signal.Signals(os.WTERMSIG(status)).name
        except ValueError:
            name = f"signal {os.WTERMSIG(status)}"
        why = _LIKELY.get(name)
        return f"killed by {name}" + (f": {why}" if why else "")
    return f"the kernel's process exited with status {os.WEXITSTATUS(status)} without a result"


def enabled(requested: bool = True) -> bool:
    """Isolation is on unless the options or ``REFMLA_ISOLATE=0`` turn it off, and needs os.fork or spawn."""
    return requested and os.environ.get(ENV, "1") != "0"


def cuda_in_play() -> bool:
    """True when a child must be spawned: CUDA initialized here, or a CUDA device a kernel will use."""
    if torch.cuda.is_initialized():
        return True
    try:
        return torch.cuda.device_count() > 0  # NVML-based where possible; does not create a context
    except Exception:
        return False


def run_isolated(fn: Callable[..., Any], *args: Any, wall_s: float | None = None, retry: bool = True) -> Any:
    """``fn(*args)`` in a child process; its return value, or its exception re-raised here:
    BackendUnavailable and refmla.kernel.InterfaceError as themselves, anything else as KernelError,
    a death as KernelCrashed (a forked child still running after ``wall_s`` seconds too: run once
    more unless ``retry`` is False, when ``wall_s`` is a deadline rather than a hang's limit)."""
    if not hasattr(os, "fork") or cuda_in_play():  # a spawned child inherits no lock: only a deadline bounds it
        return _spawned(fn, args, None if retry else wall_s)
    try:
        return _forked(fn, args, wall_s)
    except KernelTimeout:
        if not retry:
            raise  # once more in a fresh child: a lock the fork inherited is the fork's
        return _forked(fn, args, wall_s)  # doing, not the kernel's; a kernel that hangs again is the finding


# --------------------------------------------------------------------------------------------
# The reply: ("ok", value) | ("unavailable", text) | ("interface", text) | ("error", text),
# torch.save'd, length-prefixed
# --------------------------------------------------------------------------------------------


def _reply(fn: Callable[..., Any], args: tuple) -> bytes:
    try:
        msg: tuple = ("ok", fn(*args))
    except BackendUnavailable as e:
        msg = ("unavailable", str(e))
    except InterfaceError as e:  # a callable that does not meet refmla.kernel's interface: the caller's usage error
        msg = ("interface", str(e))
    except BaseException as e:  # everything the kernel raises is the parent's to report
        msg = ("error", error_text(e))
    buf = io.BytesIO()
    try:
        torch.save(msg, buf)
    except Exception as e:  # a result that cannot be sent is the backend's error, said as such
        buf = io.BytesIO()
        torch.save(("error", f"cannot send the result: {error_text(e)}"), buf)
    return buf.getvalue()


def _unpack(data: bytes) -> Any:
    kind, value = torch.load(io.BytesIO(data), weights_only=False)
    if kind == "ok":
        return value
    if kind == "unavailable":
        raise BackendUnavailable(value)
    if kind == "interface":
        raise InterfaceError(value)
    raise KernelError(value)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(struct.pack("<Q", len(data)) + data)
    while view:
        view = view[os.write(fd, view) :]


def _framed(data: bytes) -> bytes | None:
    """The payload of a complete length-prefixed reply, None when the child died mid-way."""
    if len(data) < 8:
        return None
    (n,) = struct.unpack("<Q", data[:8])
    return data[8:] if len(data) - 8 == n else None


def _forked(fn: Callable[..., Any], args: tuple, wall_s: float | None = None) -> Any:
    r, w = os.pipe()
    sys.stdout.flush(), sys.stderr.flush()  # the child must not write this process's buffers twice
    pid = os.fork()
    if pid == 0:  # the child: compute, reply, and leave without running this process's exit handlers
        code = 0
        try:
            faulthandler.disable()  # the report names the crash; no traceback dump on this stderr
            torch.set_num_threads(1)  # the parent's OpenMP team did not survive the fork (see above)
            os.close(r)
            _write_all(w, _reply(fn, args))
        except BaseException:
            code = 1
        finally:
            os._exit(code)
    os.close(w)
    try:
        data, killed = _read_watched(r, pid, wall_s)
    except BaseException:  # SIGINT / SIGTERM (or anything) here: the child must not outlive this process
        _end_child(pid)
        raise
    finally:
        os.close(r)
    if killed is not None:
        os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    if killed is not None:
        raise killed
    payload = _framed(data)
    if payload is None or os.WIFSIGNALED(status):
        raise KernelCrashed(crash_text(status))
    return _unpack(payload)


def _end_child(pid: int) -> None:
    """Kill a forked child and reap it (it may have exited already)."""
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass


def stall_seconds() -> float:
    """Seconds a forked child may go without using CPU nor replying (``REFMLA_STALL_S``, default 60)."""
    try:
        return max(0.1, float(os.environ.get(STALL_ENV, "") or DEFAULT_STALL_S))
    except ValueError:
        return DEFAULT_STALL_S


def cpu_ticks(pid: int) -> int | None:
    """The process's user + system CPU time in clock ticks (all its threads), None without /proc."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()  # after "pid (comm)": comm may hold spaces
        return int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
    except (OSError, IndexError, ValueError):
        return None


def _read_watched(fd: int, pid: int, wall_s: float | None = None) -> tuple[bytes, KernelCrashed | None]:
    """Everything the child writes to ``fd`` until it closes it, and None (all is well); or what it
    has written and why it is to be killed, as the error to raise: it neither writes nor uses CPU for stall_seconds() (a
    forked CPU kernel that progresses computes: one asleep that long waits on what will never come,
    e.g. a lock held at the fork by a thread the child does not have), or it has not replied after
    ``wall_s`` seconds (one that spins). Without /proc, only the wall-time limit."""
    chunks, limit, started = [], stall_seconds(), time.monotonic()
    ticks, idle = cpu_ticks(pid), 0.0
    while True:
        ready, _, _ = select.select([fd], [], [], WATCH_S)
        if ready:
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                return b"".join(chunks), None
            chunks.append(chunk)
            idle = 0.0
            continue
        if wall_s is not None and time.monotonic() - started >= wall_s:
            return b"".join(chunks), KernelTimeout(WALL_TEXT.format(s=wall_s))
        now = cpu_ticks(pid)
        idle = 0.0 if now is None or now != ticks else idle + WATCH_S
        ticks = now if now is not None else ticks
        if now is not None and idle >= limit:
            return b"".join(chunks), KernelCrashed(STALL_TEXT.format(s=limit))


def _spawn_main(conn) -> None:
    """The spawned child: choose the Triton interpreter when there is no GPU, then run and reply."""
    from refmla.backends.triton_interp import ensure_interpreter

    ensure_interpreter()
    fn, args = pickle.loads(conn.recv_bytes())
    conn.send_bytes(_reply(fn, args))
    conn.close()


def _spawned(fn: Callable[..., Any], args: tuple, wall_s: float | None = None) -> Any:
    """``fn(*args)`` in a spawned child; one with no reply after ``wall_s`` seconds (a deadline) is
    killed: KernelTimeout."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_spawn_main, args=(child,), daemon=True)
    proc.start()
    child.close()
    try:
        parent.send_bytes(pickle.dumps((fn, args)))
        if wall_s is not None and not parent.poll(wall_s):  # (the handler below kills the child)
            raise KernelTimeout(WALL_TEXT.format(s=wall_s))
        data = parent.recv_bytes()
    except (EOFError, OSError, BrokenPipeError):
        data = None
    except BaseException:  # SIGINT / SIGTERM here: the child must not outlive this process
        proc.kill()
        proc.join()
        parent.close()
        raise
    proc.join()
    parent.close()
    if data is None:
        code = proc.exitcode if proc.exitcode is not None else 1
        status = (-code) if code < 0 else (code << 8)  # as a wait status: signal or exit code
        raise KernelCrashed(crash_text(status))
    return _unpack(data)
