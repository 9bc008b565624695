"""``refmla disagg``: a prefill node's and a decode node's captures in, one verdict per request out.

For every (request, layer, rank) of the decode captures it answers the three questions of a
disaggregated deployment with the existing modules -- it re-implements none of them:

    did the prompt's KV arrive intact     refmla.diffkv (prefill-stored vs decode-received, every
                                          position, page and transfer run)
    is the decode metadata right          refmla.checks (run by each replay), refmla.series across
                                          decode steps, refmla.region_check (the MR region-size check)
    which compute path diverges           refmla.batch / refmla.pipeline through every backend,
                                          refmla.diagnosis per request

    writer.py    the first link: the prefill KV writer captures (kv_write) judged, one answer per row
    indexers.py  the indexer captures of either side: judged by the sparse decode beside them, or alone
    plan.py      headers only: decode series, each request's first decode capture, its prefill captures
    run.py       the stages in order, timed
    task.py      what a worker does per decode capture: replay it, then diff it (one read from disk)
    foreign.py   whose KV a mismatching request received
    cells.py     a row's three answers read off the stages' typed results
    classify.py  where the fault is (transfer, metadata, compute, none) and the sentences
    report.py    the typed result and its JSON (docs/contract.md section 3)
                 (rendered as text by refmla.render.disagg)
"""

from refmla.disagg.classify import classify, overall
from refmla.disagg.plan import DisaggPlan, plan_disagg
from refmla.disagg.run import run_disagg
from refmla.disagg.report import CLASSES, DecodeCell, DisaggReport, MetadataCell, Row, TransferCell

__all__ = [
    "CLASSES", "DecodeCell", "DisaggPlan", "DisaggReport", "MetadataCell", "Row", "TransferCell", "classify",
    "overall", "plan_disagg", "run_disagg",
]  # fmt: skip
