"""The processes of a sweep: the Triton interpreter's own warnings kept out of the output, the
``setup`` every process runs first, and the ``--jobs`` workers (each pinned to one GPU where
several are visible; a worker that dies costs its case an ``error``)."""

from __future__ import annotations

import contextlib
import importlib
import os
import warnings
from typing import Optional, Sequence

import numpy as np
import torch

from refmla.backends.triton_interp import ensure_interpreter
from refmla.signals import ignore_sigint
from refmla.sweep.checks import CHECKS
from refmla.sweep.report import CaseResult, CheckOutcome


@contextlib.contextmanager
def quiet_interpreter():
    """The Triton interpreter's numpy warnings kept out of the output: it evaluates masked-off lanes
    too (-inf - -inf, x / 0) and the kernels discard those results."""
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"), warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=RuntimeWarning, module=r"(triton|numpy)(\.|$)")
        yield


def run_setup(setup: Optional[str]) -> None:
    """``module:function`` or ``module:function:argument``: called before any case, in every process."""
    if setup:
        module, func, *arg = setup.split(":", 2)
        getattr(importlib.import_module(module), func)(*arg)


def visible_gpus() -> tuple[str, list[str]]:
    """(the variable that picks a process's GPUs, the GPUs it names) where more than one is
    visible; ("", []) otherwise. The variable already set is narrowed (on ROCm
    ``HIP_VISIBLE_DEVICES`` first), else ``HIP_VISIBLE_DEVICES`` on ROCm, ``CUDA_VISIBLE_DEVICES``
    on CUDA; its entries keep their own spelling (indices or UUIDs). Creates no CUDA context."""
    names = ("HIP_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES") if torch.version.hip else ("CUDA_VISIBLE_DEVICES",)
    var = next((n for n in names if os.environ.get(n) is not None), names[0])
    if os.environ.get(var) is not None:
        gpus = [g.strip() for g in os.environ[var].split(",") if g.strip()]
    else:
        try:
            gpus = [str(i) for i in range(torch.cuda.device_count())]  # NVML / amdsmi where possible
        except Exception:
            gpus = []
    return (var, gpus) if len(gpus) > 1 else ("", [])


def worker_init(threads: int, setup: Optional[str], gpu: Optional[tuple[str, str]] = None) -> None:
    """A worker's start: ``gpu`` (variable, GPU) set before anything creates a CUDA context, its
    thread share, then ``setup``."""
    if gpu is not None:
        os.environ[gpu[0]] = gpu[1]
    ignore_sigint()
    ensure_interpreter()
    quiet_interpreter().__enter__()  # for the worker's life
    torch.set_num_threads(max(1, threads))
    run_setup(setup)


def died(layout: str, point: dict, index: int, backends: Sequence[str]) -> CaseResult:
    why = "the worker process died running this case"
    res = CaseResult(index, layout, point, {})
    res.outcomes = {b: {c: CheckOutcome(c, "n/a" if i else "error", why) for i, c in enumerate(CHECKS)} for b in backends}
    return res


__all__ = ["died", "quiet_interpreter", "run_setup", "visible_gpus", "worker_init"]
