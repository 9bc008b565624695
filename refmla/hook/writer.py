"""The hook's state inside one server process: budget, one-time log lines, file names, writing.

Everything here runs inside SGLang's serving processes, so it follows three rules:

* a message that could repeat every layer of every step is logged once (:meth:`HookState.once`);
* any failure disables the hook for the rest of the process (:meth:`HookState.fail`), logged once
  with its traceback, and is never raised into the server;
* the budget (``MAX_FILES`` / ``MAX_BYTES``) is checked *before* anything is copied off the
  device, from a size estimate; reaching it stops capture cleanly (:meth:`HookState.stop`).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import traceback
from collections import defaultdict
from pathlib import Path
from typing import Any, Mapping, Optional

from refmla.hook.config import HookConfig

LOGGER_NAME = "refmla.hook"
CAPTURE_SUFFIX = ".safetensors"


def get_logger() -> logging.Logger:
    """``refmla.hook`` logger with its own stderr handler.

    SGLang configures (and sometimes replaces) the root logger after our hook is installed; an
    own handler keeps the hook's few lines visible in every process whatever SGLang does.
    """
    log = logging.getLogger(LOGGER_NAME)
    if not any(getattr(h, "_refmla", False) for h in log.handlers):
        h = logging.StreamHandler(sys.stderr)
        h._refmla = True  # type: ignore[attr-defined]
        h.setFormatter(logging.Formatter(f"[refmla.hook pid={os.getpid()}] %(levelname)s %(message)s"))
        log.addHandler(h)
        log.propagate = False
        if log.level == logging.NOTSET:
            log.setLevel(logging.INFO)
    return log


def folder_usage(out_dir: str) -> tuple[int, int]:
    """(capture files, their bytes) in ``out_dir``, finished files only (temp files start with '.')."""
    files = size = 0
    try:
        with os.scandir(out_dir) as it:
            for e in it:
                if e.name.endswith(CAPTURE_SUFFIX) and not e.name.startswith(".") and e.is_file():
                    files += 1
                    try:
                        size += e.stat().st_size
                    except OSError:
                        pass
    except FileNotFoundError:
        pass
    return files, size


def capture_name(*, mode: str, rank: int, layer: int, step: int, backend: str, pid: int) -> str:
    """``decode-tp0-L003-s000042-triton-p1234.safetensors``: sorts by mode, rank, layer, step."""
    return f"{mode}-tp{rank}-L{layer:03d}-s{step:06d}-{backend}-p{pid}{CAPTURE_SUFFIX}"


class HookState:
    """Per-process state of an installed hook. Thread-safe; all methods are cheap when inactive."""

    def __init__(self, cfg: HookConfig):
        self.cfg = cfg
        self.log = get_logger()
        self.disabled: Optional[str] = None  # set by fail(): an exception inside the hook
        self.stopped: Optional[str] = None  # set by stop(): budget reached
        self.files_written = 0
        self.bytes_written = 0
        self.skipped: dict[str, int] = defaultdict(int)  # reason -> count
        self._steps: dict[tuple[str, int], int] = defaultdict(int)  # (backend, layer) -> calls seen
        self._once: set[str] = set()
        self._lock = threading.Lock()

    # -- status -----------------------------------------------------------------------------

    @property
    def active(self) -> bool:
        return self.disabled is None and self.stopped is None

    def next_step(self, backend: str, layer_id: int) -> int:
        """Index of this forward call of (backend, layer) in this process, counting every call seen."""
        with self._lock:
            key = (backend, layer_id)
            step = self._steps[key]
            self._steps[key] = step + 1
            return step

    # -- logging ----------------------------------------------------------------------------

    def once(self, key: str, level: int, msg: str, *args: Any) -> None:
        """Log ``msg`` the first time ``key`` is seen in this process only."""
        with self._lock:
            if key in self._once:
                return
            self._once.add(key)
        self.log.log(level, msg, *args)

    def skip(self, reason: str, detail: str = "") -> None:
        """Count a call that was not captured; say why once per reason."""
        with self._lock:
            self.skipped[reason] += 1
        self.once("skip:" + reason, logging.INFO, "not captured: %s%s (said once)", reason, f" ({detail})" if detail else "")

    def fail(self, exc: BaseException) -> None:
        """An exception inside the hook: log it once with its traceback and disable the hook."""
        with self._lock:
            first = self.disabled is None
            if first:
                self.disabled = f"{type(exc).__name__}: {exc}"
        if first:
            tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
            self.log.error("capture hook disabled for this process after an exception in the hook "
                           "(the server is unaffected):\n%s", tb)  # fmt: skip

    def stop(self, reason: str) -> None:
        """Stop capturing for good in this process (budget reached); logged once."""
        with self._lock:
            first = self.stopped is None
            if first:
                self.stopped = reason
        if first:
            self.log.warning("capture stopped: %s; %d file(s), %d bytes written by this process",
                             reason, self.files_written, self.bytes_written)  # fmt: skip

    # -- budget -----------------------------------------------------------------------------

    def admit(self, estimate: int) -> bool:
        """Whether a capture of about ``estimate`` bytes fits the folder's budget; stops if not."""
        cfg = self.cfg
        files, size = folder_usage(cfg.out_dir)
        if files >= cfg.max_files:
            self.stop(f"REFMLA_CAPTURE_MAX_FILES={cfg.max_files} reached ({files} captures in {cfg.out_dir})")
            return False
        if size + estimate > cfg.max_bytes:
            self.stop(
                f"REFMLA_CAPTURE_MAX_BYTES={cfg.max_bytes} would be exceeded ({size} bytes in {cfg.out_dir}, "
                f"next capture about {estimate} bytes)"
            )
            return False
        return True

    # -- writing ----------------------------------------------------------------------------

    def write(self, name: str, tensors: Mapping[str, Any], meta: Mapping[str, Any]) -> Path:
        """Write one capture atomically (temp file + rename, by refmla.capture.write_capture)."""
        from refmla.capture import write_capture

        path = Path(self.cfg.out_dir) / name
        write_capture(path, tensors, meta, compact=False)
        return self.note_written(path)

    def note_written(self, path: Path) -> Path:
        """Count a capture another writer put in the folder (refmla.hook.sparse_call)."""
        nbytes = path.stat().st_size
        with self._lock:
            self.files_written += 1
            self.bytes_written += nbytes
        self.log.info("wrote %s (%d bytes)", path, nbytes)
        return path

    def summary(self) -> dict[str, Any]:
        return {
            "out_dir": self.cfg.out_dir,
            "files_written": self.files_written,
            "bytes_written": self.bytes_written,
            "disabled": self.disabled,
            "stopped": self.stopped,
            "skipped": dict(self.skipped),
        }
