"""The split partials routed, repeated or addressed wrongly (decode with a split schedule).

A split-KV kernel writes one partial (normalized output, lse) per (request, head, split) and a
second stage merges them. Three faults of the plan between the stages (vLLM #46997, #47766,
#45227; aiter #3910), each recomputed as the merge of the kernel's own split partials (the
reference's and the control's, refmla.context.ReplayContext.split_reference):

    kv_range_repeated     {"split", "start", "end"}   request b's split k done twice and both
                                                      partials merged (its positions weigh double)
    work_item_misrouted   {"split", "start", "end",   request b's split k merged into request c's
                           "to_request"}              output instead of b's (b misses it, c has it extra)
    partials_misaddressed {"stride", "axis", "side"}  stage 2 read partial (b, h, s) at flat row
                                                      (b * H + h) * S' + s (split stride S' != S), or
                                                      (b * H' + h) * S + s (head stride H' != H);
                                                      ``side`` "read", or "written" (stage 1 wrote at
                                                      that stride, stage 2 read the right one). Rows
                                                      no partial was written to contribute nothing

Tried right after ``split_missing`` and skipped at once without a split schedule of two or more
splits on the worst request; each candidate is a merge (no attention recomputed), screened on the
failing requests' rows, the best few confirmed on the whole output.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch

from refmla import reference as ref
from refmla.hypotheses.drivers import global_hypothesis, per_request, rescore
from refmla.hypotheses.ranges import split_count, split_schedule
from refmla.hypotheses.search import SCREEN, Candidate, Search
from refmla.results import Explanation

REPEATED, MISROUTED, MISADDRESSED = "kv_range_repeated", "work_item_misrouted", "partials_misaddressed"
STRIDES = (1, 2, 4, 8, 16, 32, 64)  # split strides a reader / writer may use
HEAD_STRIDES = (16, 32, 64, 128)  # padded head counts
TARGETS = 8  # requests a misrouted partial may have gone to: the failing ones, worst first
WORK = 1 << 25  # partial values (B x H x S x Dv) past which the family is not tried (memory)


@dataclass
class Partials:
    """The batch's split partials, reference (fp64) and control (fp64 of the control's values)."""

    parts: torch.Tensor  # [B, H, S, Dv]
    lses: torch.Tensor  # [B, H, S]
    valid: torch.Tensor  # [B, S]
    bounds: list[list[tuple[int, int]]]  # request b's non-empty split bounds
    control: Callable[[], tuple[torch.Tensor, torch.Tensor]]  # the control's (parts, lses), built on first use
    _ctl: Optional[tuple[torch.Tensor, torch.Tensor]] = None

    @property
    def cparts(self) -> torch.Tensor:
        return self._control()[0]

    @property
    def clses(self) -> torch.Tensor:
        return self._control()[1]

    def _control(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Only once a candidate screens: the control's partials cost more than the reference's."""
        if self._ctl is None:
            self._ctl = self.control()
        return self._ctl

    def merged(self, parts, lses, valid, cparts, clses, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        exp = ref.merge_splits(parts, lses, valid)[0]
        ctl = ref.merge_splits(cparts, clses, valid)[0].to(dtype)
        return exp, ctl


def partials(s: Search) -> Optional[Partials]:
    """The batch's partials (built once per search), or None without a split schedule worth it."""

    def build() -> Optional[Partials]:
        if not s.cap.is_decode or s.worst_request is None:
            return None
        bounds = [split_schedule(s, b) or [] for b in range(s.cap.batch_size)]
        if len(bounds[s.worst_request]) < 2 and not any(len(bounds[b]) >= 2 for b in s.failing[:TARGETS]):
            return None
        n = torch.tensor([split_count(s, b) for b in range(s.cap.batch_size)], dtype=torch.int32)
        S = max(1, max(len(x) for x in bounds), int(s.cap.meta.max_kv_splits or 0))  # the buffer's split stride
        if s.cap.batch_size * s.cap.num_heads * S * s.sc.kv_lora_rank > WORK:
            return None
        parts, lses, valid = s.ctx.split_reference(n, S)

        def control() -> tuple[torch.Tensor, torch.Tensor]:
            cparts, clses, _ = s.ctx.split_reference(n, S, control=True)
            return cparts.double(), clses.double()

        return Partials(parts, lses, valid, bounds, control)

    return s.memo("partials.batch", build)


# -- kv_range_repeated: per request ------------------------------------------------------------


def search_repeated(s: Search) -> Optional[Explanation]:
    if partials(s) is None:
        return None
    return per_request(s, REPEATED, find_repeated)


def find_repeated(s: Search, b: int) -> Iterator[Candidate]:
    p = partials(s)
    k_all = len(p.bounds[b])
    if k_all < 2:
        return
    cands = []
    for k in range(k_all):
        lses = p.lses[b : b + 1].clone()
        lses[:, :, k] += math.log(2)  # two equal partials merged: the split weighs double
        exp = ref.merge_splits(p.parts[b : b + 1], lses, p.valid[b : b + 1])[0]
        score = rescore(s, b, exp)
        if score < SCREEN:
            clses = p.clses[b : b + 1].clone()
            clses[:, :, k] += math.log(2)
            ctl = ref.merge_splits(p.cparts[b : b + 1], clses, p.valid[b : b + 1])[0].to(s.dtype)
            a, e = p.bounds[b][k]
            cands.append(Candidate({"split": k, "start": a, "end": e}, exp, ctl, score, {"num_kv_splits": k_all}))
    yield from sorted(cands, key=lambda c: c.score)


# -- work_item_misrouted: one partial merged into another request ------------------------------


def search_misrouted(s: Search) -> Optional[Explanation]:
    p = partials(s)
    if p is None or len(s.failing) < 2:
        return None
    return global_hypothesis(s, MISROUTED, misrouted_candidates(s, p))


def misrouted_candidates(s: Search, p: Partials) -> Iterator[Candidate]:
    failing = s.failing[:TARGETS]
    cands = []
    for b in failing:
        for k in range(len(p.bounds[b])):
            if len(p.bounds[b]) < 2:
                break
            valid = p.valid.clone()
            valid[b, k] = False  # b misses split k
            without = ref.merge_splits(p.parts[b : b + 1], p.lses[b : b + 1], valid[b : b + 1])[0]
            sb = rescore(s, b, without)
            if sb >= SCREEN:
                continue
            for c in failing:
                if c == b:
                    continue
                extra = torch.cat([p.lses[c], p.lses[b, :, k : k + 1]], -1)[None]  # c's splits and b's split k
                parts = torch.cat([p.parts[c], p.parts[b, :, k : k + 1]], 1)[None]
                valid = torch.cat([p.valid[c], torch.ones(1, dtype=torch.bool)])[None]
                sc = rescore(s, c, ref.merge_splits(parts, extra, valid)[0])
                if sc < SCREEN:
                    cand = _moved(s, p, b, k, c)
                    cand.score = max(sb, sc)
                    cands.append(cand)
    yield from sorted(cands, key=lambda c: c.score)


def _moved(s: Search, p: Partials, b: int, k: int, c: int) -> Candidate:
    """The whole output with request b's split k merged into request c instead of b."""
    S = p.parts.shape[2]
    pad = lambda t, fill: torch.cat([t, torch.full_like(t[:, :, :1], fill)], 2)  # noqa: E731  one more slot
    parts, lses, cparts, clses = pad(p.parts, 0.0), pad(p.lses, -math.inf), pad(p.cparts, 0.0), pad(p.clses, -math.inf)
    valid = torch.cat([p.valid, torch.zeros_like(p.valid[:, :1])], 1)
    valid[b, k] = False
    parts[c, :, S], lses[c, :, S], cparts[c, :, S], clses[c, :, S] = p.parts[b, :, k], p.lses[b, :, k], p.cparts[b, :, k], p.clses[b, :, k]
    valid[c, S] = True
    exp, ctl = s.ref.clone(), s.ctrl.clone()
    e2, c2 = p.merged(parts, lses, valid, cparts, clses, s.dtype)
    for r in (b, c):
        exp[r], ctl[r] = e2[r], c2[r]
    a, e = p.bounds[b][k]
    return Candidate({"request": b, "split": k, "start": a, "end": e, "to_request": c}, exp, ctl)


# -- partials_misaddressed: another stride ----------------------------------------------------


def search_misaddressed(s: Search) -> Optional[Explanation]:
    p = partials(s)
    if p is None:
        return None
    return global_hypothesis(s, MISADDRESSED, misaddressed_candidates(s, p))


def misaddressed_candidates(s: Search, p: Partials) -> Iterator[Candidate]:
    B, H, S, _ = p.parts.shape
    b_i, h_i, s_i = torch.meshgrid(torch.arange(B), torch.arange(H), torch.arange(S), indexing="ij")
    right = (b_i * H + h_i) * S + s_i  # [B, H, S] where a correct stage 1 writes / stage 2 reads
    counts = {len(x) for x in p.bounds} | {int(n) for n in (s.cap.num_kv_splits.tolist() if s.cap.num_kv_splits is not None else [])}
    strides = sorted({*STRIDES, *counts} - {S, 0})  # the powers of two, and the split counts themselves
    settings = [("split", x, (b_i * H + h_i) * x + s_i) for x in strides]
    settings += [("head", x, (b_i * x + h_i) * S + s_i) for x in HEAD_STRIDES if x > H]
    rows = torch.cat([s.rows_of(b) for b in s.failing[:TARGETS]])
    cands = []
    for axis, x, other in settings:
        overlap = axis == "split" and x < S  # stage 1 writing at a split stride below S would overwrite itself
        for side, write, read in (("read", right, other), ("written", other, right)):
            if side == "written" and overlap:
                continue
            cand = _readdressed(s, p, write, read, rows)
            if cand is None:
                continue
            cand.detail = {"stride": x, "axis": axis, "side": side}
            score = float(s.row_ratio(s.o64[rows], cand.expected[rows], rows).max())
            if score < SCREEN:
                cand.score = score
                cands.append(cand)
    yield from sorted(cands, key=lambda c: c.score)


def _readdressed(s: Search, p: Partials, write: torch.Tensor, read: torch.Tensor, rows: torch.Tensor) -> Optional[Candidate]:
    """The merge when stage 1 wrote partial (b, h, s) at flat row write[b, h, s] and stage 2 read
    (b, h, s) from read[b, h, s]; rows never written hold no mass (lse -inf)."""
    B, H, S, Dv = p.parts.shape
    n = int(max(write.max(), read.max())) + 1
    if n > 64 * B * H * S:
        return None
    wmask = p.valid[:, None, :].expand(B, H, S)

    def merged(parts: torch.Tensor, lses: torch.Tensor) -> torch.Tensor:
        fo = torch.zeros(n, Dv, dtype=parts.dtype)
        fl = torch.full((n,), -math.inf, dtype=lses.dtype)
        fo[write[wmask]], fl[write[wmask]] = parts[wmask], lses[wmask]
        return ref.merge_splits(fo[read], fl[read], p.valid)[0]  # stage 2 merges the splits it believes written

    exp = merged(p.parts, p.lses)
    if torch.equal(exp, s.ref) or float(s.row_ratio(s.o64[rows], exp[rows], rows).max()) >= SCREEN:
        return None
    return Candidate({}, exp, merged(p.cparts, p.clses).to(s.dtype))
