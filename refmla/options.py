"""What one replay is asked to do: :class:`ReplayOptions`, every option a backend or the replay
reads, typed, and the bounds every command that replays checks them against.

The bounds are what the arithmetic supports (docs/contract.md section 2): the tolerance is
``k * control error + ulps * ulp`` per row and ``max(cos, k**2 * control cos)``; a k past 1e6
(or ulps past 1e6) accepts any finite output and k**2 must stay finite in fp64; a cosine
difference lies in [0, 2]. The CLI's flags (refmla.cli.replay_flags) and the API
(:meth:`ReplayOptions.check`) refuse the same values with the same words.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

from refmla.compare import Tolerance

# The hypothesis search and the localization hold one request's rows in fp64 (and its logits per
# query row and head): a request past this many bytes is not searched, and says so (issue 22; the
# sparse search too, issue 33)
SEARCH_REQUEST_BYTES = 2 << 30

# option -> (lowest, highest) accepted, both included
BOUNDS = {
    "k": (0.0, 1e6),  # allowed multiple of the control's error
    "ulps": (0.0, 1e6),  # plus this many output-dtype ulps
    "cos": (0.0, 2.0),  # cosine-difference ceiling: 1 - cos lies in [0, 2]
    "jobs": (1, 1024),  # worker processes
    "cu_count": (1, 1 << 16),  # compute units for SGLang's num_kv_splits heuristic
    "aiter_page_size": (1, 1 << 16),  # the page size aiter is called with (refmla.capture MAX_PAGE_SIZE)
    "repeat": (1, 1000),  # runs of each kernel backend, compared bit for bit (refmla.repeat)
}
EXTEND_IMPLS = ("auto", "triton", "torch")  # the extend backend's implementation (REFMLA_EXTEND_IMPL)


def bound_problem(name: str, value: float) -> Optional[str]:
    """Why ``value`` is not an acceptable ``name`` (BOUNDS), or None. NaN and Inf never are."""
    lo, hi = BOUNDS[name]
    if isinstance(value, float) and not math.isfinite(value):
        return f"must be a finite number in [{lo:g}, {hi:g}], got {value}"
    if not lo <= value <= hi:
        return f"must be in [{lo:g}, {hi:g}], got {value:g}"
    return None


@dataclass
class ReplayOptions:
    """Every option the replay and the backends read (no backend reads anything else)."""

    backends: Optional[Sequence[str]] = None  # None: every backend usable here
    tol: Tolerance = field(default_factory=Tolerance)
    device: Optional[str] = None  # where kernels run; None: the capture's / best available
    cu_count: int = 256  # for computing num_kv_splits when the capture lacks them (MI355X)
    explain: bool = True  # search hypotheses for failing backends
    trim: bool = True  # triton: size split buffers to the splits that hold tokens (bit-identical)
    extend_impl: Optional[str] = None  # extend backend: auto | triton | torch (None: REFMLA_EXTEND_IMPL or auto)
    aiter_page_size: Optional[int] = None  # aiter: call with this page size (None: the capture's choice)
    isolate: bool = True  # run each kernel backend in a child process (refmla.isolation): a crash is its error
    repeat: int = 1  # run each kernel backend this many times, bitwise compared (refmla.repeat; 1: once)
    buffer_fill: Optional[float] = None  # fill of the output / scratch buffers an adapter allocates (None: its own)
    kernel_seconds: Optional[float] = None  # an isolated kernel run still going after this is killed (None: no limit)

    def check(self) -> None:
        """ValueError naming the first option out of its bounds (the CLI refuses the same values)."""
        values = {"k": self.tol.k, "ulps": self.tol.ulps, "cos": self.tol.cos, "cu_count": self.cu_count,
                  "repeat": self.repeat}  # fmt: skip
        if self.aiter_page_size is not None:
            values["aiter_page_size"] = self.aiter_page_size
        for name, value in values.items():
            problem = bound_problem(name, value)
            if problem:
                raise ValueError(f"option {name}: {problem}")
        if self.extend_impl is not None and self.extend_impl.lower() not in EXTEND_IMPLS:
            raise ValueError(f"option extend_impl: must be one of {', '.join(EXTEND_IMPLS)}, got {self.extend_impl!r}")


__all__ = ["BOUNDS", "EXTEND_IMPLS", "ReplayOptions", "bound_problem"]
