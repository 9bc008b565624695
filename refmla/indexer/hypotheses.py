"""Which indexer mistake explains a wrong index set: each family proposes, for one failing request,
what the mistaken indexer did, and the produced set is judged by the one set judge
(refmla.indexer.reference.judge_request) under that mistake. Tried in this order:

    topk_unwritten             the row never written for this call: one fill value throughout (-1, 0, ...)
    topk_stale                 the previous step's indices (``prev_indices``), or another request's
                               (its produced row, or right as that request's top-k)
    compress_ratio_wrong       V4: positions in tokens (right once divided by the ratio), or the causal
                               bound of another ratio (seq_len // r)
    topk_future                entries past the causal bound, every other entry within the top-k
    topk_off_by                every entry moved by d positions (1, 2) or one page
    topk_length_wrong          the right top entries, but another count than min(K, L)
    indexer_scale_not_applied  right under logits without the key's (or q's) scale
    indexer_relu_omitted       right under logits without the relu
    indexer_weights_ignored    right under logits with every head's weight 1

A family that explains every failing request (of the first ``LIMIT``) is the explanation; else
the one that explains most, with the requests it leaves (a partial explanation).
"""

from __future__ import annotations

from typing import Callable, Iterator, Optional

import torch

from refmla.indexer.format import COMPRESS_RATIOS, IndexerCapture
from refmla.indexer.reference import RequestVerdict, Scores, SetJudgement, Variant, judge_request, logits, positions
from refmla.results import Explanation
from refmla.util import single_thread

LIMIT = 8  # failing requests the search looks at
Proposal = tuple[str, dict]  # (hypothesis, detail) for one request


def _ok(cap, b, values, scored, **kw) -> bool:
    return judge_request(cap, b, values, scored, **kw).ok


def _unwritten(cap, b, values, v: RequestVerdict, scores) -> Iterator[Proposal]:
    row = values[b]
    if v.expected and bool((row == row[0]).all()):
        yield "topk_unwritten", {"value": int(row[0])}


def _stale(cap, b, values, v, scores) -> Iterator[Proposal]:
    mine = set(values[b][values[b] != -1].tolist())
    prev = cap.prev_indices
    if prev is not None and mine and mine == set(prev[b][prev[b] != -1].tolist()):
        yield "topk_stale", {"source": "previous_step"}
        return
    for o in range(values.shape[0]):
        if o != b and mine and mine == set(values[o][values[o] != -1].tolist()):
            yield "topk_stale", {"source": "request", "request": o}
            return
    for o in range(values.shape[0]):
        if o != b and mine and cap.meta.indices_kind == "slots" and _ok(cap, o, values[b], scores[o]):
            yield "topk_stale", {"source": "request", "request": o}
            return


def _ratio(cap, b, values, v, scores) -> Iterator[Proposal]:
    r = cap.meta.compress_ratio
    if r == 1:
        return
    row = values[b]
    if cap.meta.indices_kind == "positions" and _ok(cap, b, torch.where(row >= 0, row // r, row), scores[b]):
        yield "compress_ratio_wrong", {"ratio": r, "positions_in": "tokens"}
    seq = int(cap.seq_lens[b])
    for other in COMPRESS_RATIOS:
        if other != r and seq // other < v.bound and _ok(cap, b, row, scores[b], bound=seq // other):
            yield "compress_ratio_wrong", {"ratio": r, "bound_ratio": other, "bound": seq // other}


def _future(cap, b, values, v, scores) -> Iterator[Proposal]:
    """Entries past the bound, the others all within the top-k (an off-by-one set is not this)."""
    past = sorted(e.position for e in v.extra if e.why == "past_bound")
    if past and len(past) == v.n_extra:
        yield "topk_future", {"bound": v.bound, "past_bound": len(past), "positions": past[:8]}


def _off_by(cap, b, values, v, scores) -> Iterator[Proposal]:
    row, ps = values[b], cap.meta.page_size
    pos = positions(cap, b, row[row != -1])  # shifted as positions (a slot's page is the request's page)
    for d, unit in ((1, "positions"), (-1, "positions"), (2, "positions"), (-2, "positions"), (ps, "pages"), (-ps, "pages")):
        if _ok(cap, b, torch.where(pos >= 0, pos - d, -2), scores[b], as_positions=True):
            yield "topk_off_by", {"by": d if unit == "positions" else d // ps, "unit": unit}
            return


def _length(cap, b, values, v, scores) -> Iterator[Proposal]:
    if v.chosen != v.expected and not [e for e in v.extra if e.why != "below_topk"] and v.chosen:
        if _ok(cap, b, values[b], scores[b], topk=v.chosen):
            yield "topk_length_wrong", {"expected": v.expected, "got": v.chosen}


def _variants(cap, b, values, v, scores) -> Iterator[Proposal]:
    tries = [("indexer_scale_not_applied", Variant(k_scale=False), {"scale": "k"})] if cap.meta.k_layout == "fp8" else []
    if cap.q_scale is not None:
        tries.append(("indexer_scale_not_applied", Variant(q_scale=False), {"scale": "q"}))
    tries += [("indexer_relu_omitted", Variant(relu=False), {}), ("indexer_weights_ignored", Variant(weights=False), {})]
    for name, variant, detail in tries:
        if _ok(cap, b, values[b], logits(cap, b, variant, scores.k)):
            yield name, detail


FAMILIES: tuple[Callable[..., Iterator[Proposal]], ...] = (_unwritten, _stale, _ratio, _future, _off_by, _length, _variants)


def explain(cap: IndexerCapture, values: torch.Tensor, judgement: SetJudgement, scores: Scores,
            notes: Optional[dict] = None) -> Optional[Explanation]:  # fmt: skip
    """The explanation of the failing requests of ``judgement`` (module docstring), or None."""
    with single_thread():  # many small ops (a set judged per proposal): no thread barrier each
        return _explain(cap, values, judgement.failing[:LIMIT], scores, notes)


def _explain(cap: IndexerCapture, values: torch.Tensor, failing: list, scores: Scores,
             notes: Optional[dict]) -> Optional[Explanation]:  # fmt: skip
    best: Optional[Explanation] = None
    for family in FAMILIES:
        found: dict[str, tuple[dict, list[int]]] = {}
        for v in failing:
            try:
                first = next(family(cap, v.request, values, v, scores), None)
            except Exception as e:  # a family that raises is skipped, the others go on
                if notes is not None:
                    notes.setdefault("hypothesis_errors", []).append(f"{family.__name__}: {type(e).__name__}: {e}")
                first = None
            if first is not None:
                detail, reqs = found.setdefault(first[0], (first[1], []))
                reqs.append(v.request)
        for name, (detail, reqs) in found.items():
            rest = [v.request for v in failing if v.request not in reqs]
            e = Explanation(hypothesis=name, request=reqs[0], detail={**detail, "requests": reqs}, max_abs_err=0.0,
                            explained_requests=reqs, unexplained_requests=rest)  # fmt: skip
            if not rest:
                return e
            if best is None or len(reqs) > len(best.explained_requests or []):
                best = e
    return best


__all__ = ["FAMILIES", "LIMIT", "explain"]
