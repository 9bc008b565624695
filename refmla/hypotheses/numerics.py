"""numerics {"variant": name}: the kernel computes the same attention with different rounding.

Each variant moves the control's rounding points (:class:`refmla.control.Rounding`): the output
stored toward zero / with ties away from zero / through fp16, the probabilities kept in fp32 or
rounded to bf16 / fp16 before P.V, P.V or q.k accumulated in bf16 / fp16, the split partials'
lse stored in bf16 / fp16. The control is recomputed under the variant and judged by the same
comparator and tolerance (never a looser one); since a coarser control also allows more error,
a rounding variant must in addition *fit the kernel's noise* on at least FIT (3/4) of the
(row, head) rows where the two controls differ: a deterministic variant (a store, the probabilities' or the lse's rounding)
when the output is closer, element by element (RMS over the row), to the variant's control than
to the standard control; an accumulation variant, whose noise depends on the summation order,
when the output's RMS error against the reference is closer (in ratio) to the variant control's.
A data fault changes a few requests or heads a lot and leaves the others at the standard noise,
so it never fits; a kernel that rounds differently shifts every row the same way.

The merge variants change the arithmetic, not only the rounding (lse in log2 units merged with
exp, natural lse merged with exp2, partials not normalized): for them the fp64 reference is
recomputed under the variant too, and the comparator alone decides, as for a data hypothesis.

Variants are screened on the worst request (cheap: one request's control), then the survivors
are confirmed on the whole output. Of those that confirm, the simplest is reported (by kind: a
store, the probabilities, the lse, accumulation, a merge; within a kind the best fit) and the
others are its ``alternatives``; ``variants_tried`` lists every variant with its residual on the
worst request and the rows that fit it.

The mechanism (:func:`search_variants`, :func:`try_variant`, :func:`rows_fit`) reads a failing
output through :class:`Trials`: the dense search's (:class:`DenseTrials`, each request's control
under the variant) or a sparse capture's (refmla.hypotheses.sparse, the sparse control under it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from refmla import reference as ref
from refmla.compare import Comparison
from refmla.control import Rounding, attend_control, attend_control_split
from refmla.merging import merge_partials
from refmla.hypotheses.drivers import explained, residual
from refmla.hypotheses.ranges import split_count, split_schedule
from refmla.hypotheses.search import Search
from refmla.results import Alternative, Explanation
from refmla.schedule import split_bounds

NAME = "numerics"
TRIED = "numerics.tried"  # Search.memo key: the trials as JSON, for explain_failure's notes
DISTINCT = math.log(1.25)  # rows whose two controls' RMS errors differ by less do not vote
FIT = 0.75  # share of the voting rows that must fit a rounding variant (a kernel's rounding moves them all)

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


@dataclass(frozen=True)
class Variant:
    """One way a kernel may round differently, named for the report."""

    name: str
    kind: str  # KINDS: what it changes, simplest first
    rounding: Rounding
    description: str

    @property
    def math(self) -> bool:  # changes the arithmetic (the merges): the reference is recomputed under it
        return self.kind == "merge"

    @property
    def noisy(self) -> bool:  # its noise depends on the summation order: judged by the noise's size
        return self.kind == "accumulation"


KINDS = ("store", "probabilities", "lse", "accumulation", "merge")
VARIANTS = (
    Variant("out_round_toward_zero", "store", Rounding(store="toward_zero"), "output stored rounding toward zero"),
    Variant("out_round_half_away", "store", Rounding(store="half_away"), "output stored to nearest, ties away from zero"),
    Variant("out_through_fp16", "store", Rounding(store="via_fp16"), "output stored through fp16"),
    Variant("p_fp32", "probabilities", Rounding(p_dtype=FP32), "probabilities kept in fp32 for P.V"),
    Variant("p_bf16", "probabilities", Rounding(p_dtype=BF16), "probabilities rounded to bf16 before P.V"),
    Variant("p_fp16", "probabilities", Rounding(p_dtype=FP16), "probabilities rounded to fp16 before P.V"),
    Variant("split_lse_bf16", "lse", Rounding(split_lse=BF16), "split partials' lse stored in bf16 before the merge"),
    Variant("split_lse_fp16", "lse", Rounding(split_lse=FP16), "split partials' lse stored in fp16 before the merge"),
    Variant("pv_accum_bf16", "accumulation", Rounding(pv_accum=BF16), "P.V accumulated in bf16"),
    Variant("pv_accum_fp16", "accumulation", Rounding(pv_accum=FP16), "P.V accumulated in fp16"),
    Variant("qk_accum_bf16", "accumulation", Rounding(qk_accum=BF16), "q.k accumulated in bf16"),
    Variant("qk_accum_fp16", "accumulation", Rounding(qk_accum=FP16), "q.k accumulated in fp16"),
    Variant("merge_log2_as_ln", "merge", Rounding(merge="log2_as_ln"), "split lse stored in log2 units, merged with exp"),
    Variant("merge_ln_as_log2", "merge", Rounding(merge="ln_as_log2"), "natural split lse merged with exp2"),
    Variant("merge_unnormalized", "merge", Rounding(merge="unnormalized"), "split partials stored without 1/sum(p)"),
)
BY_NAME = {v.name: v for v in VARIANTS}


@dataclass
class Trial:
    """One variant on the worst request (and on the whole output when it screened)."""

    variant: str
    residual_ratio: float  # worst (row, head) error / allowed on the worst request under the variant
    rows_closer: Optional[str] = None  # "a/b": rows whose noise fits the variant better (rounding variants)
    confirmed: bool = False
    fit: float = 0.0  # the fraction in rows_closer (ranks variants of one kind)

    def to_json(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "fit"}

    def voted(self, fit: int, total: int) -> bool:
        """Record the rows' vote; True when at least FIT of the rows that tell the controls apart fit
        the variant (and some do)."""
        self.rows_closer, self.fit = f"{fit}/{total}", fit / total if total else 0.0
        return total > 0 and self.fit >= FIT


def search(s: Search) -> Optional[Explanation]:
    """The split lse's overflow, then every variant but the accumulation ones (tried first of all hypotheses)."""
    return search_lse_overflow(s) or search_kinds(s, late=False)


LSE_NO_MAX = "split_lse_no_max"
FP32_LOG_MAX = math.log(torch.finfo(FP32).max)  # 88.72: exp() of more overflows fp32


def search_lse_overflow(s: Search) -> Optional[Explanation]:
    """numerics {"variant": "split_lse_no_max"}: each split's lse taken as log(sum(exp(s))) in fp32
    without the max subtracted (CUTLASS #2274; split-KV then disabled in SGLang #6101, vLLM
    #17745): a (row, head) whose split holds logits summing past fp32's range gets lse +inf and
    the merge inf - inf: NaN. Every other row is untouched. Tried only when the output has
    non-finite values where the reference is finite (decode: the kernel's split schedule, one
    split per request without one)."""
    if not s.failing or not s.cap.is_decode or not bool((~torch.isfinite(s.o64) & torch.isfinite(s.ref)).any()):
        return None
    B = s.cap.batch_size
    n = torch.tensor([split_count(s, b) for b in range(B)], dtype=torch.int32)
    S = max(1, max(len(split_schedule(s, b) or []) for b in range(B)))
    _, lses, valid = s.ctx.split_reference(n, S)  # [B, H, S] fp64, with the max subtracted
    over = ((lses >= FP32_LOG_MAX) & valid[:, None, :]).any(-1)  # [B, H]
    if not bool(over.any()):
        return None
    rows = over[s.req_of_row]  # [R, H] decode: a row per request
    expected, control = s.ref.clone(), s.ctrl.clone()
    expected[rows], control[rows] = math.nan, math.nan
    cmp = s.confirm(expected, control)
    if not cmp.passed:
        return None
    trial = Trial(LSE_NO_MAX, round(residual(cmp), 4), confirmed=True)
    s.memo(TRIED, list).append(trial.to_json())
    extra = {"scope": "all requests", "variants_tried": [trial.to_json()],
             "why": "split lse taken without the max subtracted, in fp32: +inf past "
             f"{FP32_LOG_MAX:.2f}, the merge NaN", "overflowed_rows": int(rows.sum()),
             "largest_split_lse": round(float(lses[valid[:, None, :].expand_as(lses)].max()), 3)}  # fmt: skip
    return explained(s, NAME, {"variant": LSE_NO_MAX}, cmp, extra)


def search_late(s: Search) -> Optional[Explanation]:
    """The accumulation variants (tried after every other hypothesis): judged only by the size of
    their noise, they would also fit a structured fault of that size (a 0.2 % scale), which a
    data hypothesis names exactly when it is one."""
    return search_kinds(s, late=True)


def search_kinds(s: Search, late: bool) -> Optional[Explanation]:
    if not s.failing:
        return None
    return search_variants(DenseTrials(s), applicable(s), s.memo(TRIED, list), late)  # also read when another hypothesis answers


class Trials:
    """What trying a variant needs of one failing output: the dense Search's (:class:`DenseTrials`),
    or a sparse capture's (refmla.hypotheses.sparse). ``rows`` None is the whole output."""

    def screen(self, v: Variant) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The worst request's rows [T], its expectation (fp64) and its control under ``v``."""
        raise NotImplementedError

    def whole(self, v: Variant, rows: torch.Tensor, exp: torch.Tensor, ctl: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole output's expectation and control under ``v`` (the screened rows' given)."""
        raise NotImplementedError

    def judge(self, expected: torch.Tensor, control: torch.Tensor, rows: Optional[torch.Tensor]) -> Comparison:
        raise NotImplementedError  # the comparator, with the replay's tolerance

    def vote(self, rows: Optional[torch.Tensor], expected: torch.Tensor, control: torch.Tensor, noisy: bool) -> tuple[int, int]:
        raise NotImplementedError  # rows_fit on those rows

    def explained(self, detail: dict, cmp: Comparison, extra: dict, alts: list[Alternative]) -> Explanation:
        raise NotImplementedError


def search_variants(t: Trials, variants: list[Variant], tried: list[dict], late: bool) -> Optional[Explanation]:
    """Try the variants of one half (``late``: the accumulation ones), each appended to ``tried``; of
    those that confirm, the simplest by kind (then the best fit) with the others as alternatives."""
    hits = []
    for i, v in enumerate(w for w in variants if w.noisy == late):
        trial, hit = try_variant(t, v)
        tried.append(trial.to_json())
        if hit is not None:
            hits.append(((KINDS.index(v.kind), -trial.fit, i), v, hit))
    if not hits:
        return None
    hits.sort(key=lambda h: h[0])
    (_, v, cmp), rest = hits[0], [(w, c) for _, w, c in hits[1:]]
    alts = [Alternative(NAME, {"variant": w.name}, None, residual(c)) for w, c in rest]
    extra = {"scope": "all requests", "why": v.description, "variants_tried": list(tried)}
    return t.explained({"variant": v.name}, cmp, extra, alts)


def applicable(s: Search) -> list[Variant]:
    """The variants that change something on this capture."""
    cap = s.cap
    splits = cap.is_decode and cap.num_kv_splits is not None and bool((cap.num_kv_splits > 1).any())
    return variants_for(s.dtype, cap.kv_buffer.dtype, splits)


def variants_for(out_dtype: torch.dtype, value_dtype: torch.dtype, splits: bool) -> list[Variant]:
    """The variants that change something on an output stored in ``out_dtype`` whose control rounds
    P to ``value_dtype``; the lse and merge variants only with split partials."""
    out = []
    for v in VARIANTS:
        r = v.rounding
        if r.store != "nearest_even" and (out_dtype.itemsize >= 4 or (r.store == "via_fp16" and out_dtype == FP16)):
            continue  # nothing is rounded on the store
        if r.p_dtype is not None and r.p_dtype == value_dtype:
            continue  # the standard control already rounds P to the value dtype
        if (r.split_lse is not None or r.merge != "ln") and not splits:
            continue
        out.append(v)
    return out


def try_variant(t: Trials, v: Variant) -> tuple[Trial, Optional[Comparison]]:
    """Screen ``v`` on the worst request, then confirm it on the whole output."""
    rows, exp, ctl = t.screen(v)
    cmp = t.judge(exp, ctl, rows)
    trial = Trial(v.name, round(residual(cmp), 4))
    if not v.math:
        if not (trial.voted(*t.vote(rows, exp, ctl, v.noisy)) and cmp.passed):
            return trial, None
    elif not cmp.passed:
        return trial, None
    expected, control = t.whole(v, rows, exp, ctl)
    whole = t.judge(expected, control, None)
    if not v.math:
        trial.confirmed = trial.voted(*t.vote(None, expected, control, v.noisy)) and whole.passed
    else:
        trial.confirmed = whole.passed
    return trial, whole if trial.confirmed else None


class DenseTrials(Trials):
    """A dense capture's variants: each request's control recomputed under the variant (request_under)."""

    def __init__(self, s: Search):
        self.s = s

    def screen(self, v):
        b = self.s.worst_request
        return (self.s.rows_of(b), *request_under(self.s, b, v))

    def whole(self, v, rows, exp, ctl):
        s, b = self.s, self.s.worst_request
        expected, control = s.ref.clone(), s.ctrl.clone()
        for r in range(s.cap.batch_size):
            if r != b and len(s.rows_of(r)):
                expected[s.rows_of(r)], control[s.rows_of(r)] = request_under(s, r, v)
        expected[rows], control[rows] = exp, ctl
        return expected, control

    def judge(self, expected, control, rows):
        return self.s.confirm(expected, control, rows)

    def vote(self, rows, expected, control, noisy):
        return closer_rows(self.s, rows, expected, control, noisy)

    def explained(self, detail, cmp, extra, alts):
        return explained(self.s, NAME, detail, cmp, extra, alts)


def request_under(s: Search, b: int, v: Variant) -> tuple[torch.Tensor, torch.Tensor]:
    """Request b's rows under variant v: the fp64 expectation (the reference, or for a merge
    variant the reference's partials merged that way) [T, H, Dv] and the control in s.dtype."""
    cap, r = s.cap, s.req(b)
    if r.kvs is None:  # the request's rows in the stored dtype, gathered once per search
        r.kvs = ref.gather(cap.kv_buffer, r.pool_rows, cap.kv_buffer.dtype)
    H, Dv = r.q64.shape[1], s.sc.kv_lora_rank
    ctl = torch.empty(r.T, H, Dv, dtype=s.dtype)
    n = int(cap.num_kv_splits[b]) if cap.is_decode and cap.num_kv_splits is not None else 1
    for t in range(r.T):
        q = cap.q[r.rows[t]]
        if n > 1:
            ctl[t] = attend_control_split(q, r.kvs, s.sc, s.dtype, n, v.rounding, cap.split_block)[0]
        else:
            ctl[t] = attend_control(q, r.kvs[: int(r.vis[t])], s.sc, s.dtype, v.rounding)[0]
    exp = s.ref[r.rows]
    if v.math and n > 1:
        exp = merged64(s, b, n, v.rounding)[None]
    return exp, ctl


def merged64(s: Search, b: int, n: int, rnd: Rounding) -> torch.Tensor:
    """Decode request b's fp64 split partials (SGLang's schedule, n splits) merged under ``rnd``: [H, Dv]."""
    r, sc = s.req(b), s.sc
    S = r.raw[0] * sc.sm_scale  # [H, L]
    if sc.logit_cap > 0:
        S = sc.logit_cap * torch.tanh(S / sc.logit_cap)
    V = r.kv64[:, : sc.kv_lora_rank] * sc.v_scale  # [L, Dv]
    outs, lses, sums = [], [], []
    for a, e in split_bounds(r.L, n, s.cap.split_block):
        if e <= a:
            continue
        m = S[:, a:e].amax(-1, keepdim=True)  # [H, 1]
        p = torch.exp(S[:, a:e] - m)  # [H, l]
        z = p.sum(-1)  # [H]
        outs.append(p @ V[a:e] / z[:, None])
        lses.append(m[:, 0] + torch.log(z))
        sums.append(z)
    if len(outs) == 1:
        return outs[0]
    return merge_partials(torch.stack(outs), torch.stack(lses), torch.stack(sums), rnd)


def closer_rows(
    s: Search, rows: Optional[torch.Tensor], expected: torch.Tensor, control: torch.Tensor, noisy: bool
) -> tuple[int, int]:
    """:func:`rows_fit` of the search's output on ``rows`` (None: all), as the replay compared them."""
    o = s.o64 if rows is None else s.o64[rows]
    std = (s.ctrl if rows is None else s.ctrl[rows]).double()
    mask = s.mask if rows is None else (s.mask[rows] if s.mask is not None else None)
    return rows_fit(o, std, control.double(), expected, mask, noisy)


def rows_fit(
    o: torch.Tensor, std: torch.Tensor, var: torch.Tensor, e: torch.Tensor, mask: Optional[torch.Tensor], noisy: bool
) -> tuple[int, int]:
    """(rows whose noise fits the variant better, rows where the two controls differ).

    o: the output, std / var: the standard and the variant's control, e: the expectation, all
    [T, H, Dv] fp64; mask [T]: the rows compared (None: all). Per compared (row, head),
    deterministic variants: the RMS difference of the output from the standard control and from
    the variant's; a row where the controls differ votes for the closer. ``noisy`` variants: the
    RMS error against ``e`` of the output, of the standard control and of the variant's; a row
    votes when the two controls' errors differ by more than DISTINCT (in ratio), for the one whose
    error is closer to the output's (in ratio).
    """
    fin = torch.isfinite(o) & torch.isfinite(e) & torch.isfinite(std) & torch.isfinite(var)
    n = fin.sum(-1).clamp(min=1)

    def log_rms(x: torch.Tensor) -> torch.Tensor:  # [T, H]
        d = torch.where(fin, x - e, torch.zeros_like(e))
        return 0.5 * torch.log((d * d).sum(-1) / n + 1e-300)

    if not noisy:
        ds, dv = log_rms(o - std + e), log_rms(o - var + e)  # RMS of out - control, as logs
        votes = (var != std).any(-1)
        fit = votes & (dv < ds)
        if mask is not None:
            votes, fit = votes & mask[:, None], fit & mask[:, None]
        return int(fit.sum()), int(votes.sum())
    lo, ls, lv = log_rms(o), log_rms(std), log_rms(var)
    votes = (lv - ls).abs() > DISTINCT
    if mask is not None:
        votes &= mask[:, None]
    fit = votes & ((lo - lv).abs() < (lo - ls).abs())
    return int(fit.sum()), int(votes.sum())
