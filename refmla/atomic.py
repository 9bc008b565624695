"""Atomic file writes, for every file refmla writes (captures, synth, golden files and manifest, plots,
the capture hook). The bottom of the import graph: imports nothing of refmla.

A write either puts the complete new file under its name or changes nothing:

* the target must be absent or a regular file: a device (``/dev/full``), a FIFO, a directory or a
  symbolic link is refused, never replaced;
* an existing target is replaced only when refmla can prove it wrote it (:func:`written_by_refmla`:
  the marker every refmla file carries, a ``format`` beginning ``refmla.`` in a safetensors header
  or a JSON object, ``Software: refmla`` in a PNG) or it is empty: a user's file under that name is
  refused (:data:`NOT_OURS`), never replaced;
* the bytes go to an anonymous ``O_TMPFILE`` inode in the target's folder where the filesystem has
  it (a writer killed mid-write leaves nothing: the kernel frees the inode), linked under a temp
  name through ``/proc/self/fd`` once complete and fsync'd, then renamed over the target (a link
  cannot replace a file); elsewhere the bytes go to ``.NAME.refmla-tmp.PID`` directly;
* a temp name left by a killed writer (its PID no longer runs) is swept by the next write to the
  same folder;
* the file's mode is what ``open`` would give: ``0666 & ~umask``;
* every failure is one :class:`WriteError` line naming the path.
"""

from __future__ import annotations

import errno
import json
import os
import re
import stat
import struct
from pathlib import Path
from typing import Any, Optional, Sequence, Union

from refmla.util import printable

TMP_MARK = ".refmla-tmp."
MARKER = "refmla"  # a safetensors header's / JSON object's "format" begins "refmla."; a PNG's Software text is "refmla"
NOT_OURS = "exists and refmla did not write it (no refmla marker): not replaced; move it or choose another path"
_HEADER_LIMIT = 1 << 26  # a safetensors header or a JSON document refmla writes is far below 64 MiB
_PNG = b"\x89PNG\r\n\x1a\n"
_TMP_RE = re.compile(r"^\..+" + re.escape(TMP_MARK) + r"(\d+)$")


class WriteError(Exception):
    """A file could not be written: ``str()`` is one line, ``PATH: reason``."""

    def __init__(self, path: Any, reason: str):
        self.path, self.reason = str(path), reason
        super().__init__(printable(f"{self.path}: cannot write: {reason}"))


def _reason(e: BaseException) -> str:
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    return str(e).splitlines()[0] if str(e).strip() else type(e).__name__


def temp_name(path: Path, pid: int) -> Path:
    return path.with_name(f".{path.name}{TMP_MARK}{pid}")


def check_target(path: Path) -> Optional[os.stat_result]:
    """Raise WriteError unless ``path`` is absent or a regular file (lstat: a link is refused too);
    returns its lstat (None: absent)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise WriteError(path, _reason(e)) from None
    mode = st.st_mode
    if not stat.S_ISREG(mode):
        kind = ("a directory" if stat.S_ISDIR(mode) else "a symbolic link" if stat.S_ISLNK(mode)
                else "not a regular file")  # fmt: skip
        raise WriteError(path, f"{kind}; refusing to replace it")
    return st


def _refmla_format(doc: Any, key: str = "format") -> bool:
    return isinstance(doc, dict) and isinstance(doc.get(key), str) and doc[key].startswith(MARKER + ".")


def _png_software(f) -> bool:
    """A PNG whose text chunks (before its image data) hold ``Software`` = ``refmla...``."""
    for _ in range(64):
        head = f.read(8)
        if len(head) < 8:
            return False
        size, kind = struct.unpack(">I4s", head)
        if kind in (b"IDAT", b"IEND") or size > _HEADER_LIMIT:
            return False
        data = f.read(size)
        f.read(4)  # crc
        key, _, value = data.partition(b"\0")
        if kind == b"tEXt" and key == b"Software" and value.startswith(MARKER.encode()):
            return True
    return False


def written_by_refmla(path: Any) -> bool:
    """Whether the file at ``path`` carries refmla's marker (the module docstring); reads its head only."""
    try:
        with open(path, "rb") as f:
            first = f.read(8)
            if first == _PNG:
                return _png_software(f)
            if first.lstrip()[:1] == b"{":  # a JSON document (a manifest)
                doc = json.loads(first + f.read(_HEADER_LIMIT))
                return _refmla_format(doc)
            if len(first) == 8:  # safetensors: u64 little-endian header size, the JSON header
                size = struct.unpack("<Q", first)[0]
                if 2 <= size <= _HEADER_LIMIT:
                    header = json.loads(f.read(size))
                    return isinstance(header, dict) and _refmla_format(header.get("__metadata__"))
    except (OSError, ValueError, RecursionError, UnicodeDecodeError):
        return False
    return False


def check_replaceable(path: Path) -> None:
    """check_target, and an existing non-empty file must be refmla's own (written_by_refmla): else WriteError."""
    st = check_target(path)
    if st is not None and st.st_size and not written_by_refmla(path):
        raise WriteError(path, NOT_OURS)


def beside(path: Any, tries: int = 1000) -> Path:
    """``path`` when refmla may write it (check_replaceable), else the first ``NAME.N.EXT`` beside it
    (N = 2, 3, ...) that it may: a writer that must not stop (the sweep's shrunk captures) writes
    there instead of over a user's file. WriteError when none of ``tries`` names is free."""
    path = Path(path)
    suffix = "".join(path.suffixes[-1:])
    stem = path.name[: len(path.name) - len(suffix)] if suffix else path.name
    for n in range(1, tries + 1):
        candidate = path if n == 1 else path.with_name(f"{stem}.{n}{suffix}")
        try:
            check_replaceable(candidate)
        except WriteError:
            continue
        return candidate
    raise WriteError(path, f"it and {tries - 1} names beside it are taken by files refmla did not write")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: it runs, as someone else
        return True
    return True


def sweep(folder: Path) -> list[Path]:
    """Remove the temp files of dead writers in ``folder`` (regular files only); returns them."""
    removed = []
    try:
        names = os.listdir(folder)
    except OSError:
        return removed
    for name in names:
        m = _TMP_RE.match(name)
        if not m or _pid_alive(int(m.group(1))):
            continue
        p = folder / name
        try:
            if stat.S_ISREG(os.lstat(p).st_mode):
                os.unlink(p)
                removed.append(p)
        except OSError:
            pass
    return removed


def _open_anonymous(folder: Path) -> Union[int, None]:
    """An O_TMPFILE descriptor in ``folder``, or None where the filesystem (or OS) lacks it."""
    flag = getattr(os, "O_TMPFILE", None)
    if flag is None or not os.path.isdir("/proc/self/fd"):
        return None
    try:
        return os.open(folder, flag | os.O_WRONLY | getattr(os, "O_CLOEXEC", 0), 0o666)
    except OSError as e:
        if e.errno in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL, errno.ENOENT):
            return None
        raise


Data = Union[bytes, bytearray, memoryview, Sequence[Union[bytes, bytearray, memoryview]]]


def _write_all(fd: int, data: Data) -> None:
    for chunk in [data] if isinstance(data, (bytes, bytearray, memoryview)) else data:
        view = memoryview(chunk).cast("B")
        while view:
            n = os.write(fd, view)
            view = view[n:]
    os.fsync(fd)


def write_bytes(path: Any, data: Data, *, make_parents: bool = False) -> Path:
    """Write ``data`` (bytes, or a sequence of byte chunks written in order) to ``path`` atomically
    (see the module docstring). Raises WriteError."""
    path = Path(path)
    folder = path.parent
    try:
        if os.path.lexists(folder) and not os.path.isdir(folder):
            raise WriteError(path, f"{folder} is not a directory")
        if make_parents:
            folder.mkdir(parents=True, exist_ok=True)
        check_replaceable(path)
        sweep(folder)
        tmp = temp_name(path, os.getpid())
        if not _write_anonymous(folder, tmp, data):
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
            try:
                _write_all(fd, data)
            finally:
                os.close(fd)
        try:
            check_replaceable(path)  # again, just before the rename
            os.replace(tmp, path)
        finally:
            if os.path.lexists(tmp):
                os.unlink(tmp)
        _fsync_dir(folder)
    except WriteError:
        raise
    except (OSError, ValueError) as e:
        raise WriteError(path, _reason(e)) from None
    return path


def _write_anonymous(folder: Path, tmp: Path, data: Data) -> bool:
    """Write ``data`` to an O_TMPFILE inode in ``folder`` and link it as ``tmp``; False where the
    filesystem cannot (the caller then writes ``tmp`` by name)."""
    fd = _open_anonymous(folder)
    if fd is None:
        return False
    try:
        _write_all(fd, data)
        dfd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            if os.path.lexists(tmp):  # a stale temp of a reused PID
                os.unlink(tmp)
            # a dir fd makes CPython call linkat(..., AT_SYMLINK_FOLLOW): link() would not follow /proc's link
            os.link(f"/proc/self/fd/{fd}", tmp.name, src_dir_fd=dfd, dst_dir_fd=dfd, follow_symlinks=True)
        except OSError as e:
            if e.errno in (errno.EXDEV, errno.ENOENT, errno.EPERM, errno.EOPNOTSUPP):
                return False
            raise
        finally:
            os.close(dfd)
    finally:
        os.close(fd)
    return True


def make_dir(path: Any) -> Path:
    """mkdir -p that fails as one WriteError line (a file in the way, a read-only parent)."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise WriteError(path, "exists and is not a directory") from None
    except OSError as e:
        raise WriteError(path, _reason(e)) from None
    return path


def write_text(path: Any, text: str, *, make_parents: bool = False) -> Path:
    return write_bytes(path, text.encode("utf-8"), make_parents=make_parents)


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


__all__ = ["MARKER", "NOT_OURS", "TMP_MARK", "WriteError", "beside", "check_replaceable", "check_target", "make_dir", "sweep",
           "temp_name", "write_bytes", "write_text", "written_by_refmla"]
