"""Small idioms every layer uses. The bottom of the import graph: imports nothing of refmla."""

from __future__ import annotations

import contextlib
import math
from typing import Any, Iterator, Optional, Union

import torch


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> "bfloat16"."""
    return str(dtype).replace("torch.", "")


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
