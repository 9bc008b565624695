"""N runs of one kernel on the same inputs, compared bit for bit (nondeterminism).

A kernel that races (aiter's split-K reduce, #4420 / #4350: NaN sometimes on byte-identical
inputs) can pass one replay and fail the next. ``refmla replay --repeat N`` runs each kernel
backend N times and hands the runs' tensors to :func:`compare_runs`: any bit that differs from
run 0 is the finding ``nondeterministic``, even when every run is within the tolerance.

Bitwise: each tensor is viewed as integers of its width, so NaN equals NaN when the bits match
and -0.0 differs from 0.0 (a kernel that is deterministic writes the same bits).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

import torch

_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True)
class RepeatOutcome:
    """How N runs of one kernel on the same inputs differed from run 0."""

    runs: int  # runs compared (>= 2)
    differing_runs: int  # runs whose bits differ from run 0 in any compared tensor
    differing_elements: int  # elements that differ from run 0, summed over runs and tensors
    worst_tensor: Optional[str]  # name of the tensor with the largest |difference| (None when all equal)
    worst_index: Optional[tuple[int, ...]]
    worst_values: Optional[tuple[float, float]]  # (run 0's value, the differing run's value); NaN kept

    @property
    def deterministic(self) -> bool:
        return self.differing_runs == 0

    def to_json(self) -> dict:
        def num(x: float) -> Any:  # NaN / Inf as strings: JSON has no NaN
            return x if math.isfinite(x) else str(x)

        return {
            "runs": self.runs, "differing_runs": self.differing_runs, "differing_elements": self.differing_elements,
            "worst_tensor": self.worst_tensor, "worst_index": list(self.worst_index) if self.worst_index else None,
            "worst_values": [num(v) for v in self.worst_values] if self.worst_values else None,
            "deterministic": self.deterministic,
        }  # fmt: skip

    def text(self) -> str:
        if self.deterministic:
            return f"{self.runs} runs bitwise identical"
        a, b = self.worst_values or (math.nan, math.nan)
        return (f"nondeterministic: {self.differing_runs} of {self.runs - 1} repeated runs differ from run 0 in "
                f"{self.differing_elements} elements; worst {self.worst_tensor}{list(self.worst_index or ())}: "
                f"{a!r} vs {b!r}")  # fmt: skip


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().cpu().contiguous()
    return t.view(_INT_OF_WIDTH[t.element_size()]) if t.is_floating_point() else t


def _gap(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| in fp64 per element, inf where exactly one is NaN / Inf or their signs of inf differ."""
    a, b = a.detach().cpu().double(), b.detach().cpu().double()
    d = (a - b).abs()
    return torch.where(torch.isnan(d), torch.full_like(d, math.inf), d)


def compare_runs(runs: Sequence[Mapping[str, torch.Tensor]]) -> RepeatOutcome:
    """Compare every run with run 0, bit for bit (NaN == NaN when the bits match; -0.0 != 0.0)."""
    if len(runs) < 2:
        raise ValueError(f"compare_runs needs at least 2 runs, got {len(runs)}")
    first = {name: _bits(t) for name, t in runs[0].items()}
    differing_runs = differing = 0
    worst: Optional[tuple[float, str, tuple[int, ...], float, float]] = None
    for run in runs[1:]:
        run_differs = False
        for name, t in run.items():
            base = first.get(name)
            mine = _bits(t)
            if base is None or base.shape != mine.shape:  # a tensor missing or reshaped: all of it differs
                run_differs, differing = True, differing + mine.numel()
                continue
            diff = base != mine
            n = int(diff.sum())
            if not n:
                continue
            run_differs, differing = True, differing + n
            gap = torch.where(diff, _gap(runs[0][name], t), torch.zeros((), dtype=torch.float64))
            flat = int(torch.argmax(gap.flatten()))  # inf (a NaN on one side) wins
            g = float(gap.flatten()[flat])
            if worst is None or g > worst[0]:
                idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), gap.shape))
                worst = (g, name, idx, float(runs[0][name].flatten()[flat]), float(t.flatten()[flat]))
        differing_runs += run_differs
    if worst is None:
        return RepeatOutcome(len(runs), differing_runs, differing, None, None, None)
    _, name, idx, a, b = worst
    return RepeatOutcome(len(runs), differing_runs, differing, name, idx, (a, b))


def run_tensors(run) -> dict[str, torch.Tensor]:
    """The tensors a repeated run is compared on: its ``out``, and its ``lse`` where it returns one
    (a dense BackendResult or a sparse PathOutput alike)."""
    return {"out": run.out, **({"lse": run.lse} if getattr(run, "lse", None) is not None else {})}


__all__ = ["RepeatOutcome", "compare_runs", "run_tensors"]
