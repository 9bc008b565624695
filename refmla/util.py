"""Small idioms every layer uses. The bottom of the import graph: imports nothing of refmla."""

from __future__ import annotations

import contextlib
import math
import re
from typing import Any, Iterator, Optional, TextIO, Union

import torch


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> "bfloat16"."""
    return str(dtype).replace("torch.", "")


# C0 / C1 controls (ESC, BEL, newline, DEL, CSI ...), lone surrogates, and the line separators and
# bidirectional overrides that reorder what a terminal shows
_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069\ud800-\udfff]")


def printable(text: Any, keep: str = "") -> str:
    """``text`` safe for a terminal or a log line: every control character (ESC, BEL, newline, ...),
    lone surrogate and bidi override as a backslash escape ("\\x1b", "\\ud800"), except those in ``keep``.

    The one escaping function: renderers apply it to every field that comes from a file (paths,
    meta strings, rids, tensor names), and the CLI's output streams apply it (keeping newlines) to
    everything they write. JSON needs none of it (the encoder escapes)."""

    def escape(m: re.Match) -> str:
        c = m.group()
        if c in keep:
            return c
        return f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}"

    return _UNPRINTABLE.sub(escape, str(text))


class PrintableStream:
    """A text stream whose writes go through :func:`printable` (newline, tab and carriage return
    kept): what the CLI puts around stdout and stderr, so no byte of a file reaches the terminal raw
    and a lone surrogate is written as its escape instead of raising UnicodeEncodeError."""

    def __init__(self, stream: TextIO):
        self.stream = stream

    def write(self, text: str) -> int:
        return self.stream.write(printable(text, keep="\n\t\r"))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


def present(**values) -> dict:
    """The keyword arguments that are not None (a JSON object's optional keys)."""
    return {k: v for k, v in values.items() if v is not None}


def check_choice(what: str, name: str, choices) -> None:
    """ValueError ``unknown {what} {name!r}; choose from ...`` unless ``name`` is one of ``choices``."""
    if name not in choices:
        raise ValueError(f"unknown {what} {name!r}; choose from {', '.join(choices)}")


def first_line(e: Union[BaseException, str]) -> str:
    """The first non-empty line of an exception's message (or a string); "" when there is none."""
    s = str(e).strip()
    return s.splitlines()[0] if s else ""


def error_text(e: BaseException) -> str:
    """"TypeName: first line" -- how an unexpected exception is reported in one line."""
    line = first_line(e)
    return f"{type(e).__name__}: {line}" if line else type(e).__name__


def request_label(b: Optional[int], rid: Optional[str] = None) -> str:
    """"request 3 (rid abc)", or "request 3" without a rid."""
    return f"request {b}" + (f" (rid {rid})" if rid is not None else "")


def roundness(a: int, e: int) -> int:
    """How round both ends of a range [a, e) are: the trailing zero bits of the less round end
    (0 counts as round as can be). Among ranges within noise of each other (their ends carry little
    attention mass) the one a transfer or a write of aligned chunks would leave is the roundest."""
    return min((x & -x).bit_length() - 1 if x else 63 for x in (a, e))


def cdiv(a, b):
    """ceil(a / b) for non-negative ints or integer tensors."""
    return (a + b - 1) // b


def json_safe(x: Any) -> Any:
    """Replace NaN/Inf floats (not JSON) with None, recursively; objects with ``to_json`` are converted."""
    if hasattr(x, "to_json"):
        x = x.to_json()
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    return x


@contextlib.contextmanager
def single_thread() -> Iterator[None]:
    """torch.set_num_threads(1) within the block, restored after.

    For code made of many small index operations on a machine shared with other work: each
    intra-op parallel region waits at a barrier for every thread, and a descheduled thread costs
    a scheduler time slice (measured: 20 ms per 4096-element index on 2 loaded cores, 0.02 ms with
    one thread). The bulk work there is numpy / memcmp, which does not use torch threads anyway.
    """
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


MMAP_THRESHOLD = 1 << 20  # bytes: an allocation this large or larger is its own mapping, returned when freed
_heap_steady = False


def steady_heap() -> None:
    """Large blocks go back to the system when freed (glibc's mmap threshold fixed at MMAP_THRESHOLD).
    glibc raises that threshold with every large block freed (up to 32 MiB); the blocked work's
    buffers then come from the heap, whose freed holes stay resident and grow block after block
    (the comparator's 16 MiB blocks over a 20,000-row output held +1.2 GiB; with the threshold
    fixed, +0.13 GiB). Once per process, on glibc only; only in the `refmla` command's own process
    (refmla.cli.main without argv): never from a hook (the server's heap is its own) or the Python
    API (the caller's process), whose allocation speed it would change (each block a fresh mapping)."""
    global _heap_steady
    if _heap_steady:
        return
    _heap_steady = True
    try:
        import ctypes

        ctypes.CDLL(None).mallopt(-3, MMAP_THRESHOLD)  # M_MMAP_THRESHOLD (glibc's malloc.h)
    except (OSError, AttributeError):  # not glibc: its own allocator's behaviour stands
        pass
