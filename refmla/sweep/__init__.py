"""``refmla sweep``: every backend checked over the shape space production runs, not only the
calls someone captured (issue 30; docs/contract.md, the sweep).

Modules (imports go down this list):

    report.py   typed results: CheckOutcome, CaseResult, Finding, Trigger, BackendSweep, SweepReport
    space.py    the axes per layout and the walk: pairwise coverage first, then random, from the seed
    cases.py    a point made concrete (a GoldenCase) and its capture tensors (refmla.golden.build)
    checks.py   the four checks per backend: reference, nan_fill, repeat, splits
    shrink.py   a failing case made smaller while it fails the same check
    run.py      the walk within the budget (serial or ``jobs`` workers), then shrink, capture, replay
"""

from refmla.sweep.checks import CHECKS
from refmla.sweep.report import SweepReport
from refmla.sweep.run import SweepConfig, run_sweep
from refmla.sweep.space import LAYOUTS

__all__ = ["CHECKS", "LAYOUTS", "SweepConfig", "SweepReport", "run_sweep"]
