"""A kernel's recorded launch plan checked without running anything (``refmla inspect``).

aiter's persistent MLA decode (``get_mla_metadata_v1``) writes the plan the kernel follows:

    work_indptr        [cu + 1]      CU c runs work items work_indptr[c] .. work_indptr[c + 1]
    work_info_set      [works, 8]    per item: batch_idx, partial_loc (-1: written straight to the
                                     output), qo_start, qo_end, kv_start, kv_end (kv_indices entries),
                                     kv_offset, q_head_range (head_start | head_end << 16)
    reduce_indptr      [tiles + 1]   tile t merges partials reduce_partial_map[reduce_indptr[t] ..]
    reduce_final_map   [tiles, 2]    tile t's output: qo row reduce_final_map[t, 0]
    reduce_partial_map [partials]    each merged partial's row in the partial buffer

A correct plan covers every (request, head, kv entry) exactly once, each item within its own
request's queries and KV, and reduces every partial it writes, once, into its own request's row.
:func:`check_aiter_plan` lists every violation (at most MAX_VIOLATIONS), the first one named:

    work_item_misrouted   an item's KV range lies in another request's entries, or its queries
                          are another request's (a work item routed to a neighbouring request)
    work_list_stale       an item of a request or KV past this batch (a previous batch's tail)
    kv_range_repeated     entries [s, e) of a request's heads done by two items
    kv_range_uncovered    entries [s, e) of a request's heads done by none
    partials_misaddressed a partial written twice, reduced into another request's row, reduced
                          twice or never, or reduced without being written
    plan_unreadable       the maps do not parse as that layout (a finding, never a crash)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from refmla.capture import Capture

MAX_VIOLATIONS = 16


@dataclass
class PlanViolation:
    kind: str  # one of the kinds in the module docstring
    message: str  # one sentence for people
    detail: dict[str, Any] = field(default_factory=dict)  # work_item(s), request, heads, entries, partial, row

    def to_json(self) -> dict:
        return {"kind": self.kind, "message": self.message, "detail": self.detail}


@dataclass
class PlanCheck:
    """What the plan check found: ``violations`` in the order found, the first one named."""

    source: str  # "aiter persistent work / reduce maps"
    work_items: int
    kernel_heads: int
    violations: list[PlanViolation] = field(default_factory=list)
    unit: str = "work items"  # what work_items counts ("SM parts" for FlashMLA's plan)

    @property
    def ok(self) -> bool:
        return not self.violations

    @property
    def first(self) -> Optional[PlanViolation]:
        return self.violations[0] if self.violations else None

    def to_json(self) -> dict:
        return {"source": self.source, "work_items": self.work_items, "kernel_heads": self.kernel_heads,
                "unit": self.unit, "ok": self.ok, "first": self.first.to_json() if self.first else None,
                "violations": [v.to_json() for v in self.violations]}  # fmt: skip


@dataclass(frozen=True)
class WorkItem:
    i: int
    b: int
    partial: int
    qo: tuple[int, int]
    kv: tuple[int, int]
    heads: tuple[int, int]


def _items(cap: Capture) -> list[WorkItem]:
    n = int(cap.aiter_work_indptr.long()[-1])
    rows = cap.aiter_work_info_set.long()[:n].tolist()
    return [WorkItem(i, r[0], r[1], (r[2], r[3]), (r[4], r[5]), (r[7] & 0xFFFF, (r[7] >> 16) & 0xFFFF))
            for i, r in enumerate(rows)]  # fmt: skip


def has_aiter_plan(cap: Capture) -> bool:
    return all(getattr(cap, f"aiter_{n}") is not None for n in
               ("work_indptr", "work_info_set", "reduce_indptr", "reduce_final_map", "reduce_partial_map"))  # fmt: skip


def check_aiter_plan(cap: Capture) -> Optional[PlanCheck]:
    """The plan check of a capture holding aiter's persistent work / reduce maps (None: it holds none)."""
    if not has_aiter_plan(cap):
        return None
    try:
        return _check(cap)
    except Exception as e:  # a plan refmla cannot read is a finding about the plan, never a crash of inspect
        check = PlanCheck("aiter persistent work / reduce maps", 0, 0)
        check.violations.append(PlanViolation("plan_unreadable", f"the work / reduce maps do not parse as aiter's "
                                              f"layout: {type(e).__name__}: {e}"))  # fmt: skip
        return check


def _check(cap: Capture) -> PlanCheck:
    items = _items(cap)
    B = cap.batch_size
    kv = cap.kv_indptr.long().tolist()
    qo = cap.qo_indptr.long().tolist() if cap.qo_indptr is not None else list(range(B + 1))
    heads = int(cap.meta.extra.get("aiter_kernel_heads") or 0) or _common_head_end(items, cap.num_heads)
    check = PlanCheck("aiter persistent work / reduce maps", len(items), heads)
    add = check.violations.append
    wi = cap.aiter_work_indptr.long()
    if bool((wi[1:] < wi[:-1]).any()) or int(wi[0]) != 0:
        add(PlanViolation("work_list_stale", "work_indptr is not monotone from 0: the CUs' item lists overlap"))
    if int(wi[-1]) > cap.aiter_work_info_set.shape[0]:
        add(PlanViolation("work_list_stale", f"work_indptr ends at item {int(wi[-1])}, past the "
                          f"{cap.aiter_work_info_set.shape[0]} items the work list holds", {"work_items": int(wi[-1])}))  # fmt: skip
    placed: dict[int, list[WorkItem]] = {b: [] for b in range(B)}
    for w in items:
        v = _misplaced(w, B, kv, qo, heads)
        if v is not None:
            add(v)
        else:
            placed[w.b].append(w)
    for b in range(B):
        _coverage(b, placed[b], kv[b + 1] - kv[b], kv[b], heads, add)
    _partials(cap, items, B, qo, add)
    del check.violations[MAX_VIOLATIONS:]
    return check


def _common_head_end(items: list[WorkItem], H: int) -> int:
    ends = [w.heads[1] for w in items]
    return max(set(ends), key=ends.count) if ends else H


def _owner(pos: int, bounds: list[int]) -> Optional[int]:
    for b in range(len(bounds) - 1):
        if bounds[b] <= pos < bounds[b + 1]:
            return b
    return None


def _misplaced(w: WorkItem, B: int, kv: list[int], qo: list[int], H: int) -> Optional[PlanViolation]:
    """The violation of an item outside its own request (or this batch), or None."""
    d = {"work_item": w.i, "request": w.b, "kv_entries": list(w.kv), "qo_rows": list(w.qo), "heads": list(w.heads)}
    if not 0 <= w.b < B or w.kv[1] > kv[-1] or w.qo[1] > qo[-1]:
        return PlanViolation("work_list_stale", f"work item {w.i} is for request {w.b}, KV entries "
                             f"[{w.kv[0]}, {w.kv[1]}), rows [{w.qo[0]}, {w.qo[1]}): past this batch of {B} "
                             f"requests / {kv[-1]} entries (a previous batch's item?)", d)  # fmt: skip
    if not (kv[w.b] <= w.kv[0] <= w.kv[1] <= kv[w.b + 1]):
        c = _owner(w.kv[0], kv)
        d["reads_request"] = c
        return PlanViolation("work_item_misrouted", f"work item {w.i} is for request {w.b} but reads KV entries "
                             f"[{w.kv[0]}, {w.kv[1]}), request {c}'s (request {w.b}'s are [{kv[w.b]}, {kv[w.b + 1]}))", d)  # fmt: skip
    if (w.qo[0], w.qo[1]) != (qo[w.b], qo[w.b + 1]):
        d["rows_of_request"] = _owner(w.qo[0], qo)
        return PlanViolation("work_item_misrouted", f"work item {w.i} reads request {w.b}'s KV for query rows "
                             f"[{w.qo[0]}, {w.qo[1]}), request {d['rows_of_request']}'s", d)  # fmt: skip
    if not 0 <= w.heads[0] < w.heads[1] <= H:
        return PlanViolation("work_item_misrouted", f"work item {w.i} runs heads [{w.heads[0]}, {w.heads[1]}) of "
                             f"a {H}-head launch", d)  # fmt: skip
    return None


def _runs(mask: torch.Tensor) -> list[tuple[int, int]]:
    """[start, end) of each run of True in a 1-D bool tensor."""
    x = torch.cat([torch.zeros(1, dtype=torch.int8), mask.to(torch.int8), torch.zeros(1, dtype=torch.int8)])
    d = x[1:] - x[:-1]
    return list(zip(torch.nonzero(d == 1).flatten().tolist(), torch.nonzero(d == -1).flatten().tolist()))


def _coverage(b: int, items: list[WorkItem], L: int, base: int, H: int, add) -> None:
    """Every (head, entry) of request b covered exactly once: the first repeated / uncovered range per head band."""
    if L <= 0:
        return
    diff = torch.zeros(H, L + 1, dtype=torch.int32)
    for w in items:
        diff[w.heads[0] : w.heads[1], w.kv[0] - base] += 1
        diff[w.heads[0] : w.heads[1], w.kv[1] - base] -= 1
    cnt = diff.cumsum(1)[:, :L]  # [H, L]
    for kind, bad in (("kv_range_repeated", cnt > 1), ("kv_range_uncovered", cnt == 0)):
        rows = torch.nonzero(bad.any(1)).flatten().tolist()
        if not rows:
            continue
        h0 = rows[0]
        h1 = h0 + 1
        while h1 < H and torch.equal(bad[h1], bad[h0]):  # the band of heads with the same ranges
            h1 += 1
        s, e = _runs(bad[h0])[0]
        d = {"request": b, "heads": [h0, h1], "kv_entries": [base + s, base + e], "positions": [s, e]}
        if kind == "kv_range_repeated":
            d["work_items"] = [w.i for w in items if w.heads[0] <= h0 < w.heads[1] and w.kv[0] - base <= s < w.kv[1] - base]
            add(PlanViolation(kind, f"request {b}, heads {h0}..{h1 - 1}: KV entries [{s}, {e}) done by work items "
                              f"{d['work_items']} (twice)", d))  # fmt: skip
        else:
            add(PlanViolation(kind, f"request {b}, heads {h0}..{h1 - 1}: KV entries [{s}, {e}) done by no work item", d))


def _partials(cap: Capture, items: list[WorkItem], B: int, qo: list[int], add) -> None:
    """Each partial row written once, reduced once, into its own request's row."""
    writer: dict[int, WorkItem] = {}
    for w in items:
        if w.partial < 0:
            continue
        for r in range(w.partial, w.partial + min(max(1, w.qo[1] - w.qo[0]), max(1, qo[-1]))):  # its query rows
            if r in writer:
                add(PlanViolation("partials_misaddressed", f"partial row {r} written by work items {writer[r].i} and "
                                  f"{w.i}", {"partial": r, "work_items": [writer[r].i, w.i]}))  # fmt: skip
            writer[r] = w
    ri = cap.aiter_reduce_indptr.long().tolist()
    final = cap.aiter_reduce_final_map.long()
    pmap = cap.aiter_reduce_partial_map.long().tolist()
    reduced: dict[int, int] = {}
    for t in range(len(ri) - 1):
        row = int(final[t, 0]) if t < final.shape[0] else -1
        into = _owner(row, qo)
        for k in range(ri[t], min(ri[t + 1], len(pmap))):
            p = pmap[k]
            w = writer.get(p)
            d = {"partial": p, "tile": t, "row": row, "work_item": w.i if w else None, "request": w.b if w else None}
            if p in reduced:
                add(PlanViolation("partials_misaddressed", f"partial row {p} reduced twice (tiles {reduced[p]} and {t})", d))
            reduced[p] = t
            if w is None:
                add(PlanViolation("partials_misaddressed", f"tile {t} reduces partial row {p}, which no work item "
                                  f"writes", d))  # fmt: skip
            elif into != w.b:
                add(PlanViolation("partials_misaddressed", f"partial row {p} (work item {w.i}, request {w.b}) reduced "
                                  f"into row {row}, request {into}'s", d))  # fmt: skip
    for p in sorted(set(writer) - set(reduced)):
        w = writer[p]
        add(PlanViolation("partials_misaddressed", f"partial row {p} (work item {w.i}, request {w.b}) is never reduced",
                          {"partial": p, "work_item": w.i, "request": w.b}))  # fmt: skip


__all__ = ["MAX_VIOLATIONS", "PlanCheck", "PlanViolation", "check_aiter_plan", "has_aiter_plan"]
