"""The sweep's budget: its clock, what a case costs and whether it still fits.

    now()        the clock every budget decision reads (time.monotonic; one clock for every
                 process of a machine, so a ``--jobs`` worker reads the walk's deadline as set)
    work(case)   the elements a case attends: query rows x 16-head tiles x (tokens each row attends
                 + ROW_TOKENS a split)
    CostModel    seconds = overhead + rate x work, per (backend, layout), fitted to the cases this
                 run has timed; it predicts a case's cost before it starts
    CutOff       raised where a case meets its deadline: the kernel's child is killed there, and
                 the checks it had not finished are ``not run`` ("not run: budget"), never a pass
                 or a finding

The walk starts no case whose predicted cost passes what is left of the budget (it goes on to the
next point, which may be cheaper); a case it does start is cut off at budget x (1 + OVERRUN),
the allowance the last case gets. A backend with no timed case yet predicts nothing (its first
case starts; the deadline bounds it).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from refmla.isolation import KernelTimeout, run_isolated
from refmla.sweep.report import NOT_RUN
from refmla.sweep.space import sparse_valid

OVERRUN = 0.05  # a started case is cut off at budget x (1 + OVERRUN) of the walk's start
UNSTARTED_IN_A_ROW = 64  # points in a row predicted past the budget after which the walk ends
ROW_TOKENS = 256  # a program's fixed cost (one query row's split, a 16-head tile), counted as tokens attended


def now() -> float:
    """The budget's clock (tests put a fake one in its place)."""
    return time.monotonic()


class CutOff(Exception):
    """The case met its deadline: what it had not finished is ``not run: budget``."""

    def __init__(self) -> None:
        super().__init__("not run: budget (the case was cut off at the budget's deadline)")


def call(fn: Callable[..., Any], args: tuple, wall_s: Optional[float], deadline: Optional[float], isolated: bool) -> Any:
    """``fn(*args)`` (a kernel run; in a child process where ``isolated``) within ``deadline``
    (a :func:`now` time; None: no deadline): CutOff when it has passed, or when the child is
    killed there (the child is not run again, as one past ``wall_s`` is). In-process the
    deadline is checked before the run only."""
    if deadline is None:
        return run_isolated(fn, *args, wall_s=wall_s) if isolated else fn(*args)
    left = deadline - now()
    if left <= 0:
        raise CutOff()
    if not isolated:
        return fn(*args)
    bounded = wall_s is None or left < wall_s
    try:
        return run_isolated(fn, *args, wall_s=left if bounded else wall_s, retry=not bounded)
    except KernelTimeout:
        if bounded:
            raise CutOff() from None
        raise


def work(case: Any) -> int:
    """What a case attends, in elements: its heads in tiles of 16 (the heads one program of SGLang's
    and vLLM's kernels takes) x, per query row, the tokens it attends plus ROW_TOKENS per split (a
    program's fixed cost, which the Triton interpreter makes large): a dense case's requests (verify:
    ``draft_token_num`` rows each), a sparse case's valid entries of both caches
    (refmla.sweep.space.sparse_valid), one split a row; an indexer case's entries x index heads."""
    if hasattr(case, "entries"):  # an indexer case: every index head scores every entry of its request
        return int(case.heads) * sum(int(n) + ROW_TOKENS for n in case.entries)
    heads = -(-int(case.num_heads) // 16) * 16
    if hasattr(case, "cache"):  # a sparse case: one query row per request
        return heads * sum(sparse_valid(int(n), case.cache, int(case.topk)) + ROW_TOKENS for n in case.seq_lens)
    rows = max(1, int(getattr(case, "draft_token_num", 0) or 0))
    splits = getattr(case, "splits", None) or (1,) * len(case.seq_lens)
    return heads * rows * sum(int(n) + ROW_TOKENS * int(s) for n, s in zip(case.seq_lens, splits))


@dataclass
class CostModel:
    """seconds = overhead + rate x work per (backend, layout), least squares over the timed cases
    (both >= 0; one work size seen: through the origin, the rate of what was seen)."""

    seen: dict = field(default_factory=dict)  # (backend, layout) -> [(work, seconds)]

    def add(self, backend: str, layout: str, elements: int, seconds: float) -> None:
        self.seen.setdefault((backend, layout), []).append((float(elements), float(seconds)))

    def predict(self, backend: str, layout: str, elements: int) -> Optional[float]:
        """Predicted seconds of ``backend`` on a case of ``elements`` in ``layout``; None before any."""
        obs = self.seen.get((backend, layout))
        if not obs:
            return None
        ws, ss = [w for w, _ in obs], [s for _, s in obs]
        n, mw, ms = len(obs), sum(ws) / len(obs), sum(ss) / len(obs)
        var = sum((w - mw) ** 2 for w in ws) / n
        if var <= 0:
            return ms * elements / mw if mw > 0 else ms
        rate = max(0.0, sum((w - mw) * (s - ms) for w, s in obs) / n / var)
        overhead = max(0.0, ms - rate * mw)
        return overhead + rate * elements

    def case_seconds(self, backends: Sequence[str], layout: str, elements: int) -> float:
        """The predicted seconds of a case over ``backends`` (those with no timed case count 0)."""
        return sum(p for b in backends if (p := self.predict(b, layout, elements)) is not None)


__all__ = ["NOT_RUN", "OVERRUN", "UNSTARTED_IN_A_ROW", "CostModel", "CutOff", "call", "now", "work"]
