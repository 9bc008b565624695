"""Shrinking a failing case: fewer requests, shorter lengths, fewer heads, as long as it still fails
the same check (Hypothesis' shrinking, Polygraphy's ``debug reduce``): the engineer gets the
smallest reproduction the tries allow.

Greedy: the first smaller candidate that still fails is kept and the candidates start over from
it; shrinking ends when no candidate fails, after ``max_tries`` runs, or at the deadline. A
block-table case keeps its one split count for the batch; a sparse case shrinks its requests,
their contexts and its heads (refmla.sweep.sparse.sparse_candidates), an indexer case its requests,
their entries and its index heads (refmla.sweep.indexer.indexer_candidates).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Iterator, Optional

from refmla.golden.cases import GoldenCase
from refmla.options import ReplayOptions
from refmla.sweep import budget
from refmla.sweep.checks import Evidence
from refmla.sweep.report import CheckOutcome
from refmla.sweep.space import HEADS
from refmla.sweep.indexer import IndexerSweepCase, indexer_candidates
from refmla.sweep.sparse import AnyCase, SparseSweepCase, any_checks, sparse_candidates


def _keep(case: GoldenCase, which: list[int]) -> GoldenCase:
    return replace(case, seq_lens=tuple(case.seq_lens[i] for i in which),
                   num_kv_splits=tuple(case.splits[i] for i in which))  # fmt: skip


def candidates(case: AnyCase) -> Iterator[tuple[str, AnyCase]]:
    """Smaller cases than ``case``, the biggest cuts first: (what changed, the case)."""
    if isinstance(case, SparseSweepCase):
        yield from sparse_candidates(case)
        return
    if isinstance(case, IndexerSweepCase):
        yield from indexer_candidates(case)
        return
    B = len(case.seq_lens)
    if B > 1:
        half = B // 2
        yield f"requests {B} -> {half}", _keep(case, list(range(half)))
        yield f"requests {B} -> {B - half}", _keep(case, list(range(half, B)))
        for i in range(B):
            yield f"requests {B} -> {B - 1} (request {i} dropped)", _keep(case, [j for j in range(B) if j != i])
    low = max(1, case.draft_token_num)
    for i, L in enumerate(case.seq_lens):
        for shorter in dict.fromkeys((max(low, L // 2), L - 1)):
            if L > low and shorter < L:
                lens = case.seq_lens[:i] + (shorter,) + case.seq_lens[i + 1 :]
                yield f"request {i} length {L} -> {shorter}", replace(case, seq_lens=lens)
    for h in sorted(h for h in HEADS if h < case.num_heads):
        yield f"heads {case.num_heads} -> {h}", replace(case, num_heads=h)


@dataclass
class Shrunk:
    case: AnyCase
    outcome: CheckOutcome
    evidence: Optional[Evidence]  # None: the kernel raised or crashed (``error``), no output to keep
    steps: list[str] = field(default_factory=list)
    tries: int = 0


def fails(case: AnyCase, backend: str, check: str, opts: ReplayOptions, repeat: int, status: Optional[str] = None):
    """(outcome, evidence) of ``check`` on ``case`` when it fails the same way, else None: a
    ``fail`` with the failing run's output, or an ``error`` (the kernel raised or crashed; its
    evidence None). A case that fails one way and then the other is not the same failure."""
    outcomes, evidence = any_checks(case, opts, repeat).run(backend, only=(check,))
    o = outcomes.get(check)
    if o is not None and o.status == "fail" and check in evidence and (status is None or status == "fail"):
        return o, evidence[check]
    if o is not None and o.status == "error" and (status is None or status == "error"):
        return o, None
    return None


def shrink(case: AnyCase, backend: str, check: str, opts: ReplayOptions, repeat: int = 3,
           max_tries: int = 24, deadline: Optional[float] = None) -> Optional[Shrunk]:
    """The smallest case found that still fails ``check``; None when ``case`` itself no longer fails
    (a nondeterministic failure that did not come back)."""
    first = fails(case, backend, check, opts, repeat)
    if first is None:
        return None
    status = first[0].status  # a smaller case must fail as this one does (fail, or error)
    best = Shrunk(case, first[0], first[1], tries=1)
    progress = True
    while progress and best.tries < max_tries and (deadline is None or budget.now() < deadline):
        progress = False
        for step, smaller in candidates(best.case):
            if best.tries >= max_tries or (deadline is not None and budget.now() >= deadline):
                break
            best.tries += 1
            got = fails(smaller, backend, check, opts, repeat, status)
            if got is not None:
                best = Shrunk(smaller, got[0], got[1], best.steps + [step], best.tries)
                progress = True
                break
    return best


__all__ = ["Shrunk", "candidates", "fails", "shrink"]
