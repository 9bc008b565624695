"""FlashMLA's tile-scheduler plan checked without running anything (``refmla inspect``).

FlashMLA's decode runs in two kernels. ``get_mla_metadata`` (or the first ``flash_mla_with_kvcache``
of a ``FlashMLASchedMeta``) splits the batch's KV blocks of 64 tokens over ``P`` SM parts:

    tile_scheduler_metadata [P, 8] int32   part p runs (request, block) from its begin to its end, in
                                           batch order; its first request at split index begin_split,
                                           every later request of the part at split 0
    num_splits              [B + 1] int32  cumulative splits: request b's partials are rows
                                           num_splits[b] .. num_splits[b + 1] - 1 of the split buffers;
                                           one split: the part wrote the output itself, no combine

Two layouts of a row, by FlashMLA release (meta ``flashmla_sched_layout``):

    block   [begin_req, begin_block, end_req, end_block, begin_split, _, _, _]   the tensor API
            (FlashMLA 2025, sgl-kernel, SGLang's sgl-flash-mla legacy side)
    struct  [begin_req, end_req, begin_block, end_block, begin_split, first_split, last_split, _]
            (FlashMLA's DecodingSchedMeta, 2026: FlashMLASchedMeta, vLLM's vendored copy)

Requests are inclusive at both ends, blocks begin-inclusive, end-exclusive (a part that ends on a
request's whole tail says its last block + 1). A request of length L has max(1, ceil(L / 64))
blocks (an empty one still gets one); a sparse call's length is its top-k width (+ the extra
cache's, after the main one rounded up to a block).

A correct plan covers every block of every request exactly once, gives each request exactly the
splits num_splits says (0 .. n - 1, each once) and writes a request's output straight only when it
has one split. The violations are :mod:`refmla.plan`'s kinds: ``work_list_stale`` (a part past
this batch or past a request's blocks: a previous batch's plan), ``kv_range_repeated`` /
``kv_range_uncovered`` (blocks done twice / by no part), ``partials_misaddressed`` (a split row
written twice, never, past the request's splits, or a split request's piece written as if whole),
``plan_unreadable``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from refmla.plan import MAX_VIOLATIONS, PlanCheck, PlanViolation

LAYOUTS = ("block", "struct")
BLOCK_N = 64  # tokens per block of FlashMLA's decode scheduler (both layouts)
SOURCE = "FlashMLA tile-scheduler metadata"


@dataclass(frozen=True)
class Part:
    """One SM part's row, whichever layout it came in."""

    p: int
    begin_req: int
    end_req: int  # inclusive
    begin_block: int
    end_block: int  # exclusive, in end_req
    begin_split: int
    flags: Optional[tuple[int, int]] = None  # struct layout: (first request split, last request split)


def parts_of(metadata: torch.Tensor, layout: str) -> list[Part]:
    """The plan's rows as :class:`Part` (ValueError for a layout that is not one of LAYOUTS)."""
    if layout not in LAYOUTS:
        raise ValueError(f"flashmla_sched_layout {layout!r} is not one of {', '.join(LAYOUTS)}")
    rows = metadata.to(torch.int64).reshape(metadata.shape[0], -1).tolist()
    if layout == "block":
        return [Part(p, r[0], r[2], r[1], r[3], r[4]) for p, r in enumerate(rows)]
    return [Part(p, r[0], r[1], r[2], r[3], r[4], (r[5], r[6])) for p, r in enumerate(rows)]


def lengths_blocks(lengths: Sequence[int], block_n: int = BLOCK_N) -> list[int]:
    """Blocks per request as FlashMLA's scheduler counts them: an empty request still has one."""
    return [max(1, -(-int(L) // block_n)) for L in lengths]


def check_flashmla_plan(metadata: torch.Tensor, num_splits: torch.Tensor, lengths: Sequence[int],
                        layout: str, block_n: int = BLOCK_N) -> PlanCheck:  # fmt: skip
    """The plan check of one FlashMLA call: ``lengths`` are the tokens each request's blocks cover."""
    check = PlanCheck(SOURCE, int(metadata.shape[0]), 0, unit="SM parts")
    try:
        _check(check, parts_of(metadata, layout), num_splits.to(torch.int64).tolist(), list(lengths), block_n)
    except Exception as e:  # a plan refmla cannot read is a finding about the plan, never a crash of inspect
        check.violations.append(PlanViolation("plan_unreadable", f"the tile-scheduler metadata does not parse as "
                                              f"FlashMLA's {layout!r} layout: {type(e).__name__}: {e}"))  # fmt: skip
    del check.violations[MAX_VIOLATIONS:]
    return check


def _check(check: PlanCheck, parts: list[Part], cum: list[int], lengths: list[int], block_n: int) -> None:
    add = check.violations.append
    B = len(lengths)
    nblocks = lengths_blocks(lengths, block_n)
    if len(cum) != B + 1 or cum[0] != 0 or any(b < a for a, b in zip(cum, cum[1:])):
        add(PlanViolation("partials_misaddressed", f"num_splits {cum[:8]}{'...' if len(cum) > 8 else ''} is not "
                          f"{B + 1} cumulative counts from 0", {"num_splits": cum[: B + 1]}))  # fmt: skip
        return
    cover = [torch.zeros(n + 1, dtype=torch.int32) for n in nblocks]  # difference arrays per request
    doers: list[list[tuple[int, int, int]]] = [[] for _ in range(B)]  # per request: (part, first block, end block)
    splits: list[dict[int, int]] = [{} for _ in range(B)]  # per request: split index -> part
    for part in parts:
        if part.begin_req >= B and part.end_req < part.begin_req:
            continue  # an idle part (FlashMLA leaves begin past the batch when a part has no work)
        stale = _stale(part, B, nblocks)
        if stale is not None:
            add(stale)
            continue
        for b in range(part.begin_req, part.end_req + 1):
            s = part.begin_block if b == part.begin_req else 0
            e = part.end_block if b == part.end_req else nblocks[b]
            if e <= s:
                continue
            cover[b][s] += 1
            cover[b][e] -= 1
            doers[b].append((part.p, s, e))
            _split(part, b, s, e, nblocks[b], cum, splits, add)
    for b in range(B):
        if lengths[b] > 0:  # an empty request's one block holds nothing to attend
            _coverage(b, cover[b], doers[b], lengths[b], block_n, add)
        n = cum[b + 1] - cum[b]
        missing = sorted(set(range(n)) - set(splits[b]))
        if missing and n > 1:
            add(PlanViolation("partials_misaddressed", f"request {b}: split(s) {missing} of its {n} written by no part "
                              f"(the combine merges rows never written)", {"request": b, "splits": missing}))  # fmt: skip


def _stale(part: Part, B: int, nblocks: list[int]) -> Optional[PlanViolation]:
    """The violation of a part outside this batch or past a request's blocks, or None."""
    d = {"part": part.p, "requests": [part.begin_req, part.end_req], "blocks": [part.begin_block, part.end_block]}
    if not 0 <= part.begin_req <= part.end_req < B:
        return PlanViolation("work_list_stale", f"part {part.p} runs requests {part.begin_req}..{part.end_req}: past "
                             f"this batch of {B} requests (a previous batch's plan?)", d)  # fmt: skip
    if not 0 <= part.begin_block < nblocks[part.begin_req] or not 0 <= part.end_block <= nblocks[part.end_req]:
        b = part.begin_req if not 0 <= part.begin_block < nblocks[part.begin_req] else part.end_req
        d["request"] = b
        return PlanViolation("work_list_stale", f"part {part.p} runs blocks [{part.begin_block}, {part.end_block}) "
                             f"but request {b} has {nblocks[b]} (a plan for other lengths?)", d)  # fmt: skip
    return None


def _split(part: Part, b: int, s: int, e: int, nb: int, cum: list[int], splits: list[dict[int, int]], add) -> None:
    """Request b's piece [s, e) of ``part``: its split index, against num_splits and the flags."""
    n = cum[b + 1] - cum[b]
    idx = part.begin_split if b == part.begin_req else 0
    whole = s == 0 and e == nb
    d = {"part": part.p, "request": b, "split": idx, "splits_of_request": n, "blocks": [s, e]}
    if part.flags is not None:
        said = part.flags[0] if b == part.begin_req else part.flags[1] if b == part.end_req else 0
        if part.begin_req == part.end_req:
            said = part.flags[0] or part.flags[1]
        if bool(said) == whole:
            how = "as split (into the combine's rows)" if said else "straight to the output"
            add(PlanViolation("partials_misaddressed", f"part {part.p} writes request {b}'s blocks [{s}, {e}) {how}, "
                              f"but they are {'all' if whole else 'part'} of its {nb}", d))  # fmt: skip
    if whole and n == 1:
        return  # the part writes the output itself
    if whole != (n == 1) and (whole or n == 1):
        add(PlanViolation("partials_misaddressed", f"part {part.p} does request {b}'s blocks [{s}, {e}) of {nb}, but "
                          f"num_splits gives it {n} split(s)", d))  # fmt: skip
        return
    if not 0 <= idx < n:
        add(PlanViolation("partials_misaddressed", f"part {part.p} writes request {b}'s split {idx}, past its {n} "
                          f"splits (row {cum[b] + idx}: another request's partial)", d))  # fmt: skip
        return
    if idx in splits[b]:
        d["parts"] = [splits[b][idx], part.p]
        add(PlanViolation("partials_misaddressed", f"request {b}'s split {idx} (row {cum[b] + idx}) written by parts "
                          f"{splits[b][idx]} and {part.p}", d))  # fmt: skip
    splits[b][idx] = part.p


def _coverage(b: int, diff: torch.Tensor, doers: list[tuple[int, int, int]], L: int, block_n: int, add) -> None:
    """Every block of request b done exactly once: the first repeated and the first uncovered run."""
    cnt = diff.cumsum(0)[:-1]  # [blocks]
    for kind, bad in (("kv_range_repeated", cnt > 1), ("kv_range_uncovered", cnt == 0)):
        hit = torch.nonzero(bad).flatten().tolist()
        if not hit:
            continue
        s = e = hit[0]
        while e < cnt.shape[0] and bool(bad[e]):
            e += 1
        tokens = [min(s * block_n, L), min(e * block_n, L)]
        d = {"request": b, "blocks": [s, e], "positions": tokens}
        if kind == "kv_range_repeated":
            d["parts"] = [p for p, ps, pe in doers if ps <= s < pe]
            add(PlanViolation(kind, f"request {b}: blocks [{s}, {e}) (positions [{tokens[0]}, {tokens[1]})) done by "
                              f"parts {d['parts']} (twice)", d))  # fmt: skip
        else:
            add(PlanViolation(kind, f"request {b}: blocks [{s}, {e}) (positions [{tokens[0]}, {tokens[1]})) done by "
                              f"no part", d))  # fmt: skip


__all__ = ["BLOCK_N", "LAYOUTS", "Part", "check_flashmla_plan", "lengths_blocks", "parts_of"]
