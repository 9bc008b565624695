"""Where a failing backend goes wrong, explained or not (issue 21 part 2): its failing requests and
heads, for a request the positions whose removal or zeroing brings its output back (page or split
granular, then narrowed) or that carry the error, and for a split kernel the stage. When nothing
can be localized, ``tried`` says what was searched.

    types.py      Localization and Span: typed, one line of text for the table
    stages.py     split kernels: stage-1 partials, stage-1 lse, stage-2 merge, final lse
    lse.py        a final lse in log2 units (or ln where log2 was meant)
    positions.py  one request's (or split's) positions, by removing or zeroing blocks of them
    entries.py    a sparse capture's request: the top-k entries (cache, position, slot) or the cache whose removal restores
"""

from __future__ import annotations

import torch

from refmla import reference as ref
from refmla.blame import failing_requests, worst_blame
from refmla.context import ReplayContext
from refmla.localize.lse import lse_units
from refmla.localize.positions import Segment, locate
from refmla.localize.stages import split_stage
from refmla.localize.types import STAGES, Localization, Span
from refmla.results import BackendEntry
from refmla.schedule import split_bounds
from refmla.util import single_thread

MAX_REQUESTS = 4  # requests (or splits) searched for positions, worst first


def localize(ctx: ReplayContext, res, entry: BackendEntry) -> Localization:
    """The Localization of a failing backend from its BackendResult and its judged entry (one
    torch thread: hundreds of small attentions, for which intra-op threads only add barrier waits)."""
    with single_thread(), torch.no_grad():
        return _localize(ctx, res, entry)


def _localize(ctx: ReplayContext, res, entry: BackendEntry) -> Localization:
    cap = ctx.cap
    parts = failing_requests(entry, cap.request_of_row())
    blame = worst_blame(entry)
    reqs = sorted(set().union(*parts.values()), key=lambda b: (blame is None or b != blame.request, b))
    loc = Localization(requests=reqs, heads={b: _heads(ctx, res, entry, b) for b in reqs})
    found = split_stage(ctx, res, out_failed="out" in parts, lse_failed="lse" in parts)
    loc.stage, loc.tried = found.stage, [found.tried]
    if "lse" in parts:
        loc.cause = lse_units(ctx, res.lse, sorted(parts["lse"]))
    if not cap.is_decode:
        loc.tried.append("positions: decode captures only")
        return loc
    if found.stage == "stage1":
        loc.spans = _split_spans(ctx, res, found)
    elif found.stage == "stage1_lse":
        splits = res.num_kv_splits if res.num_kv_splits is not None else cap.num_kv_splits
        loc.spans = [_split_span(ctx, b, s, "its split lse is off", splits) for b, s in found.pairs[:MAX_REQUESTS]]
    elif found.stage is None and "out" in parts:
        worst = sorted(parts["out"], key=reqs.index)[:MAX_REQUESTS]
        too_large = {b: why for b in worst if (why := ctx.too_large_to_search(b))}
        loc.tried += list(too_large.values())
        searched = [b for b in worst if b not in too_large]
        loc.spans = [s for b in searched if (s := _request_span(ctx, res, entry, b))]
        if searched:
            loc.tried.append("positions: removing or zeroing each " + ("page" if cap.meta.page_size > 1 else "64 positions"))
    return loc


def _heads(ctx: ReplayContext, res, entry: BackendEntry, b: int) -> list[int]:
    cmp, rows = entry.comparison, torch.nonzero(ctx.cap.request_of_row() == b).flatten()
    if cmp is None or cmp.row_err is None:
        return []
    out, want = res.out.detach().cpu()[rows].double(), ctx.ref_out[rows]  # [T, H, Dv]
    misplaced = (torch.isfinite(out) != torch.isfinite(want)).any(-1)  # [T, H]
    bad = ~(cmp.row_err[rows] <= cmp.row_tol[rows]) | misplaced  # [T, H]
    heads = torch.nonzero(bad.any(0)).flatten().tolist()
    if not heads and entry.lse is not None and entry.lse.worst is not None and entry.lse.worst.request == b:
        heads = [int(entry.lse.worst.head)]
    return heads


def _segment(ctx: ReplayContext, b: int, start: int, end: int, target, tol, split=None) -> Segment:
    cap = ctx.cap
    rows = cap.attended().group_rows(b)[start:end]
    return Segment(b, start, cap.q[b].double(), ref.gather(cap.kv_buffer, rows, torch.float64), target.double(),
                   tol.double(), page_size=cap.meta.page_size, split=split, sc=cap.scales())  # fmt: skip


def _request_span(ctx: ReplayContext, res, entry: BackendEntry, b: int):
    cmp = entry.comparison
    L = int(ctx.cap.seq_lens[b])
    if cmp is None or cmp.row_tol is None or L == 0:
        return None
    return locate(_segment(ctx, b, 0, L, res.out[b].detach().cpu(), cmp.row_tol[b]))


def _split_span(ctx: ReplayContext, b: int, s: int, how: str, splits) -> Span:
    a, e = split_bounds(int(ctx.cap.seq_lens[b]), int(splits[b]))[s]
    P = ctx.cap.meta.page_size
    return Span(b, a, e, how, pages=(a // P, (e - 1) // P) if P > 1 else None, split=s)


def _split_spans(ctx: ReplayContext, res, found) -> list[Span]:
    """Per failing (request, split): the positions inside the split, else the split itself."""
    spans, rows = [], found.rows
    v = ctx.cap.meta.v_scale
    splits = res.num_kv_splits if res.num_kv_splits is not None else ctx.cap.num_kv_splits
    for b, s in found.pairs[:MAX_REQUESTS]:
        a, e = split_bounds(int(ctx.cap.seq_lens[b]), int(splits[b]))[s]
        if ctx.too_large_to_search(b):  # a split of a request past the search's budget: the split itself
            spans.append(_split_span(ctx, b, s, "its partial fails", splits))
            continue
        vrow = int(torch.nonzero((rows.b_idx == b) & (rows.s_idx == s)).flatten()[0])
        target = res.attn_logits[b, :, s].detach().cpu().double() * v
        span = locate(_segment(ctx, b, a, e, target, rows.cmp.row_tol[vrow], split=s))
        spans.append(span or _split_span(ctx, b, s, "its partial fails", splits))
    return spans


__all__ = ["STAGES", "Localization", "Span", "localize"]
