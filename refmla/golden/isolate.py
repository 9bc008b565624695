"""A golden check in a child process, so that a kernel that crashes the process is a result, not a dead run.

The child is ``python -m refmla.golden check FILE --backend NAME`` (:mod:`refmla.golden.__main__`);
its result comes back as JSON on stdout (:meth:`GoldenResult.to_json` / :meth:`GoldenResult.from_json`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from typing import Any, Optional

from safetensors import safe_open

from refmla.golden.check import GoldenHeader, PathLike, replay_command
from refmla.golden.result import GoldenResult


def golden_meta(path: PathLike) -> dict[str, Any]:
    """meta["golden"] of a golden file, from its header alone."""
    with safe_open(str(path), framework="pt") as f:
        return json.loads((f.metadata() or {}).get("meta", "{}")).get("golden") or {}


def check_isolated(path: PathLike, backend: str, *, timeout: float = 1800) -> GoldenResult:
    """:func:`refmla.golden.check.check` in a child process, so that a kernel that crashes the process is a result."""
    cmd = [sys.executable, "-m", "refmla.golden", "check", str(path), "--backend", backend]
    head = GoldenHeader.of(golden_meta(path), path)
    t0 = time.perf_counter()

    def died(reason: str) -> GoldenResult:
        return GoldenResult.error(head.case, backend, reason, why=head.why, seconds=time.perf_counter() - t0,
                                  replay=replay_command(path, backend, head.pool_base_row))  # fmt: skip

    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return died(f"timed out after {timeout:.0f} s")
    if proc.returncode == 0 and proc.stdout.strip():
        result = GoldenResult.from_json(json.loads(proc.stdout))
        result.seconds = time.perf_counter() - t0
        return result
    tail = (proc.stderr.strip().splitlines() or [""])[-1]
    return died(f"the process running the kernel died ({exit_how(proc.returncode)}) {tail}".strip())


def exit_how(returncode: int) -> str:
    """How a child process ended, in words: its exit status or the signal that killed it."""
    if returncode >= 0:
        return f"exit status {returncode}"
    try:
        return f"killed by {signal.Signals(-returncode).name}"
    except ValueError:
        return f"killed by signal {-returncode}"


def needs_isolation(path: PathLike) -> tuple[bool, Optional[str]]:
    """(run in a child process, reason to skip instead): pool_base_row cases allocate a >4 GiB pool."""
    base = int(golden_meta(path).get("pool_base_row", 0))
    if not base:
        return False, None
    with safe_open(str(path), framework="pt") as f:
        pool = f.get_slice("kv_buffer")
        rows, _, D = pool.get_shape()
        itemsize = 1 if pool.get_dtype().startswith("F8") else 2
    need = (base + rows) * D * itemsize
    avail = available_memory()
    if avail is not None and avail < 1.5 * need:
        return (
            True,
            f"needs about {need / 2**30:.1f} GiB for a {base + rows}-row pool; {avail / 2**30:.1f} GiB available",
        )
    return True, None


def available_memory() -> Optional[int]:
    """Free physical memory in bytes, None where the system does not say."""
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
