"""What every backend is: a name, an availability check, and run(capture) -> BackendResult."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from refmla.arithmetic import Arithmetic
from refmla.capture import Capture
from refmla.options import ReplayOptions


class BackendUnavailable(Exception):
    """Raised by run() when the backend cannot run on this machine or this capture.

    The replay reports the backend as ``skipped`` with ``str(exc)`` as the reason.
    """


@dataclass
class BackendFinding:
    """Something a backend found wrong besides its output (e.g. rebuilt kernel metadata that differs
    from production's). A replay with a finding is never a pass: docs/contract.md section 3."""

    kind: str  # machine name, e.g. "aiter_metadata_mismatch"
    message: str  # one sentence for people
    detail: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"kind": self.kind, "message": self.message, "detail": self.detail}


@dataclass
class BackendResult:
    out: torch.Tensor  # [B, H, Dv] decode, [T, H, Dv] extend, the backend's own dtype
    lse: Optional[torch.Tensor] = None  # [B, H] natural log of the scaled logits' sum-exp
    attn_logits: Optional[torch.Tensor] = None  # [B, H, S, Dv] per-split normalized partials
    attn_lse: Optional[torch.Tensor] = None  # [B, H, S] per-split lse
    num_kv_splits: Optional[torch.Tensor] = None  # [B] the split counts the partials follow
    info: dict[str, Any] = field(default_factory=dict)  # version, module path, device, notes
    # False when the kernel leaves rows of zero-length requests undefined (not compared).
    defines_empty_rows: bool = True
    # The noise floor at this path's own rounding points when they differ from the capture's (a
    # split schedule the capture does not carry: the per-query decode of a verify capture); None:
    # the replay's control (refmla.context.ReplayContext.control).
    control: Optional[torch.Tensor] = None
    control_lse: Optional[torch.Tensor] = None  # [R, H] fp32: that control's lse (None: the replay's)
    findings: list[BackendFinding] = field(default_factory=list)  # each one fails the backend (never a pass)
    # the kernel's own arithmetic (refmla.arithmetic): its control, split reference and lse base are
    # built from it; None: the capture producer's (refmla.arithmetic.producer_arithmetic)
    arithmetic: Optional[Arithmetic] = None


class Backend:
    """Base class. Subclasses set ``name`` and implement ``availability`` and ``run``."""

    name: str = ""
    # True when run() allocates the kernel's output / scratch buffers itself and fills them with
    # ReplayOptions.buffer_fill (refmla sweep's NaN-fill check); False: the kernel allocates its own
    fills_buffers: bool = False
    # the buffers the kernel reads that it allocates inside, which no fill of the caller's reaches
    # (named by the sweep's nan_fill check: those were not poisoned); "" where the caller hands them all
    unpoisoned: str = ""
    # the capture modes run() reads (a decode-only kernel: ("decode",)); () when it says at run time
    modes: tuple[str, ...] = ()
    # True when run() only reads the capture (a sparse capture's ``observed``): run in this process,
    # never in a child (refmla.isolation)
    in_process: bool = False

    def availability(self) -> tuple[bool, str]:
        """(usable here, reason if not / version string if yes). Must never raise."""
        return True, ""

    def run(self, cap: Capture, opts: ReplayOptions) -> BackendResult:
        raise NotImplementedError
