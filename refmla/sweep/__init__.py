"""``refmla sweep``: every backend checked over the shape space production runs, not only the
calls someone captured (issue 30; docs/contract.md, the sweep).

Modules (imports go down this list):

    report.py   typed results: CheckOutcome, CaseResult, Finding, Trigger, BackendSweep, SweepReport
    bounds.py   the size bounds walked, by where it runs: cpu (the interpreter's), gpu, production
    space.py    the axes per layout (decode, verify, block_table, sparse, indexer) under the bounds, and the
                walk: the largest point (GPU), the schedule's boundaries, pairwise coverage, then
                random, from the seed
    budget.py   the budget's clock, a case's cost (elements attended) and its prediction per
                backend from this run's timings, the deadline that cuts a started case off
    kernels.py  which backends sweep which layout: each layout's default kernels, why one takes none
    tables.py   the block_table case: vLLM's pool, null block, shuffled / ordered / shared table
    cases.py    a dense point made concrete (a GoldenCase, a TableCase) and its capture tensors
    checks.py   the four checks per backend on a dense case: reference, nan_fill, repeat, splits
    indexer.py  the indexer layout: its case (refmla.indexer.synth), its checks by the set judge, its capture
    sparse.py   the sparse layout: its case (refmla.sparse.synth), its checks, its capture; the
                dispatch of a case to its kind
    shrink.py   a failing case made smaller while it fails the same check
    workers.py  the sweep's processes: the interpreter's warnings kept quiet, setup, ``--jobs`` workers
    run.py      the walk within the budget (serial or ``jobs`` workers), then shrink, capture, replay
"""

from refmla.sweep.checks import CHECKS
from refmla.sweep.report import SweepReport
from refmla.sweep.run import SweepConfig, run_sweep
from refmla.sweep.space import LAYOUTS

__all__ = ["CHECKS", "LAYOUTS", "SweepConfig", "SweepReport", "run_sweep"]
