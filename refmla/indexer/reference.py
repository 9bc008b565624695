"""The indexer in fp64 (the reference), at a kernel's rounding points (the control), and the one
judge of a produced index set.

For request b with query q [H, D] (times q_scale [H] when given), weights w [H], the keys of its
entries k [L, D] and their scales s [L] (L = seq_len // compress_ratio, the causal bound):

    logits[n] = s[n] * sum_h w[h] * relu(q[h] . k[n])          n < L

and the right index set is the top min(K, L) of logits. The control is the same sum with each
head's dot product accumulated in fp32 and rounded to bf16 (SGLang's torch path, the coarsest
rounding point an engine takes), the weighted sum and the scale in fp32. The noise of request b
is ``k`` times the control's largest error over its entries plus one bf16 ulp at its largest
logit (a kernel that writes bf16 logits): ``noise = k * max_n |control - reference| + ulp_bf16``.

A produced set is right when it holds min(K, L) distinct entries, each in [0, L), and no entry
left out scores more than 2 noise above an entry chosen (each side within its noise of the k-th
best): a near-tie is decided by score, never by position. A wrong set names the entries missing
(left out, clearly in the top-k) and those that should not be there (chosen, clearly below it, or
past the bound, duplicated, not this request's), with their scores and ranks.

The work: a request's keys BLOCK at a time (fp8 to fp64 once, by a table of the 256 codes; one
fp64 GEMM [n, D] x [D, H]; the relu, both weighted sums and the scales on [n, H]), so memory is
bounded by the block, not the context; requests side by side on torch.get_num_threads()
single-threaded workers (Scores.fill). A request's bits depend on neither the block nor the workers.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Iterable, Iterator, Optional

import torch

from refmla.blocked import run_units
from refmla.indexer.format import FP8, IndexerCapture
from refmla.util import single_thread

SHOWN = 16  # entries named per request and list
BLOCK = 2048  # keys a block of the reference: converted to fp64 once, one GEMM (memory bounded by the block)


@dataclass(frozen=True)
class Variant:
    """Which parts of the math are applied (the reference applies all; a hypothesis drops one)."""

    relu: bool = True
    weights: bool = True
    k_scale: bool = True
    q_scale: bool = True


TRUE = Variant()


@dataclass
class Scored:
    """One request's logits under a variant: fp64 reference [L] and its noise (module docstring)."""

    logits: torch.Tensor  # [L] fp64
    noise: float


def blocks(cap: IndexerCapture, b: int,
           block: Optional[int] = None) -> Iterator[tuple[int, torch.Tensor, Optional[torch.Tensor]]]:  # fmt: skip
    """Request b's entries in blocks of about ``block`` (default BLOCK) keys, whole pages: (the
    block's first position, its keys k [n, D] as stored in fp64, exact: fp8 codes looked up in a
    table of their 256 values, once; their scales [n] fp64, None for bf16 keys)."""
    m, (_, _, D) = cap.meta, cap.q.shape
    L, ps = int(cap.entries[b]), m.page_size
    per = max(1, (block or BLOCK) // ps)  # pages a block
    codes = torch.arange(256, dtype=torch.uint8).view(FP8[m.fp8_dtype]).double()  # [256] each fp8 code's value, exact
    pages = cap.page_table[b, : (L + ps - 1) // ps].long()  # [n_pages] rows of k_cache
    for j in range(0, pages.numel(), per):
        rows = cap.k_cache[pages[j : j + per]]  # [p, W] uint8 | [p, ps, D]
        n = min(L - j * ps, rows.shape[0] * ps)  # the block's entries (the last page: those before L)
        if m.k_layout == "bf16":
            yield j * ps, rows.double().view(-1, D)[:n], None
            continue
        vals = codes.index_select(0, rows[:, : ps * D].int().view(-1)).view(-1, D)  # [p * ps, D] fp64
        scales = rows[:, ps * D : ps * (D + 4)].contiguous().view(torch.float32).view(-1)  # [p * ps]
        yield j * ps, vals[:n], scales[:n].double()


def keys(cap: IndexerCapture, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(k [L, D] as stored, in fp64, exact; scales [L] fp64) of request b's entries (blocks, joined)."""
    parts = list(blocks(cap, b))
    D, L = cap.q.shape[2], int(cap.entries[b])
    if not parts:
        return torch.empty(0, D, dtype=torch.float64), torch.ones(0, dtype=torch.float64)
    kv = torch.cat([k for _, k, _ in parts])
    ks = torch.cat([s for _, _, s in parts]) if parts[0][2] is not None else torch.ones(L, dtype=torch.float64)
    return kv, ks


def logits(cap: IndexerCapture, b: int, variant: Variant = TRUE, k: float = 2.0) -> Scored:
    """Request b's logits in fp64 and the noise of its control (module docstring), a block of keys
    at a time: one fp64 GEMM [n, D] x [D, H] each. fp8 q and keys make each fp64 dot product exact
    (a product of two fp8 values is a multiple of 2**-20 below 2**18: a sum of up to 2**15 of them
    fits fp64's 53 bits); q's scale multiplies the exact dot once."""
    q = cap.q_values()[b].double()  # [H, D] exact
    H, L = q.shape[0], int(cap.entries[b])
    qs = cap.q_scale[b].double() if cap.q_scale is not None and variant.q_scale else None  # [H]
    w = cap.weights[b].double() if variant.weights else torch.ones(H, dtype=torch.float64)  # [H]
    qt, wf = q.T.contiguous(), w.float()  # [D, H], [H] fp32
    ref = torch.empty(L, dtype=torch.float64)  # [L]
    errs = []  # per block: max |control - reference|
    with single_thread():  # many block-sized ops: no thread barrier each (Scores.fill runs requests side by side)
        for at, kv, ks in blocks(cap, b):
            dots = kv @ qt  # [n, H] fp64
            if qs is not None:
                dots.mul_(qs)
            if variant.relu:
                dots.clamp_min_(0)
            r = dots @ w  # [n]
            c = dots.float().bfloat16().float() @ wf  # [n] the control: each dot rounded to bf16 (after the
            # relu: a rounding keeps the sign), summed in fp32
            if ks is not None and variant.k_scale:
                r.mul_(ks)
                c.mul_(ks.float())
            ref[at : at + r.numel()] = r
            errs.append((c.double() - r).abs().max())
    if not L:
        return Scored(ref, 0.0)
    big = float(ref.abs().max())
    ulp = torch.finfo(torch.bfloat16).eps * 2.0 ** torch.tensor(big).log2().floor().item() if big > 0 else 0.0
    return Scored(ref, k * float(torch.stack(errs).max()) + ulp)


@dataclass
class Entry:
    """One entry named by a verdict: its position (None: not this request's), the value produced,
    its reference logit and rank (1 = best), and why it is named."""

    position: Optional[int]
    value: int
    score: Optional[float]
    rank: Optional[int]
    why: str  # "missing" | "below_topk" | "past_bound" | "duplicate" | "not_this_request"


@dataclass
class RequestVerdict:
    """One request's produced set judged against its reference logits."""

    request: int
    ok: bool
    expected: int  # min(K, L)
    chosen: int  # valid (not -1) entries produced
    bound: int  # L
    noise: float
    kth_score: Optional[float]  # the reference's k-th best logit
    missing: list[Entry] = field(default_factory=list)
    extra: list[Entry] = field(default_factory=list)
    n_missing: int = 0
    n_extra: int = 0
    label: str = ""  # how the text names the row ("request 3", an MTP row "request 1 token 2")

    def text(self) -> str:
        who = self.label or f"request {self.request}"
        if self.ok:
            return f"{who}: right"
        said = [f"{self.chosen} entries where {self.expected} belong"] if self.chosen != self.expected else []
        for what, lst, n in (("missing", self.missing, self.n_missing), ("should not be there", self.extra, self.n_extra)):
            if n:
                shown = ", ".join(_entry(e) for e in lst[:4])
                said.append(f"{n} {what} ({shown}{', ...' if n > 4 else ''})")
        return f"{who}: " + "; ".join(said)

    def to_json(self) -> dict:
        return asdict(self)


def _entry(e: Entry) -> str:
    where = f"position {e.position}" if e.position is not None else f"value {e.value}"
    if e.score is None:
        return f"{where} {e.why.replace('_', ' ')}"
    return f"{where} score {e.score:.4g} rank {e.rank}" + ("" if e.why in ("missing", "below_topk") else f" {e.why.replace('_', ' ')}")


def positions(cap: IndexerCapture, b: int, values: torch.Tensor, kind: Optional[str] = None) -> torch.Tensor:
    """[n] int64 positions of produced values (-1 dropped before): the values themselves, or slots
    mapped back through request b's pages (a slot in no page of b: -2, not this request's);
    ``kind`` (default the capture's indices_kind) says which the values are."""
    v = values.long()
    if (kind or cap.meta.indices_kind) == "positions":
        return v
    ps = cap.meta.page_size
    table = cap.page_table[b].long()  # every page the table gives b: a slot past the bound maps past it
    j = torch.nonzero(table >= 0).flatten()  # [n] the request's page numbers in use
    rows = table[j]
    prod = cap.k_cache_pages.long()[rows] if cap.k_cache_pages is not None else rows  # [n] production pages
    order = torch.argsort(prod)
    page = v // ps
    at = torch.searchsorted(prod[order], page).clamp(max=max(0, prod.numel() - 1))
    hit = prod.numel() > 0 and (prod[order][at] == page)
    logical = j[order[at]] if j.numel() else at  # the request's page number
    return torch.where(torch.as_tensor(hit), logical * ps + v % ps, torch.full_like(v, -2))


def judge_request(cap: IndexerCapture, b: int, values: torch.Tensor, scored: Scored, topk: Optional[int] = None,
                  bound: Optional[int] = None, as_positions: bool = False) -> RequestVerdict:  # fmt: skip
    """Request b's produced ``values`` [K] (-1 invalid) against ``scored`` (module docstring);
    ``topk`` / ``bound`` override K and L (a hypothesis' width or bound); ``as_positions``: the
    values are positions whatever the capture's indices_kind (-2: not this request's)."""
    s = scored.logits  # [L]
    L = s.numel() if bound is None else min(bound, s.numel())
    s = s[:L]
    K = cap.meta.topk if topk is None else topk
    E = min(K, L)
    vals = values[values != -1].long()
    pos = vals if as_positions else positions(cap, b, vals)
    rank = lambda p: int((s > s[p]).sum()) + 1  # noqa: E731
    kth = float(torch.topk(s, E).values[-1]) if E else None
    inside = (pos >= 0) & (pos < L)
    first = torch.zeros_like(inside)  # the first time each position inside the bound is listed
    if bool(inside.any()):
        u, inv = torch.unique(pos[inside], return_inverse=True)
        at = torch.full((u.numel(),), pos.numel(), dtype=torch.long).scatter_reduce(
            0, inv, torch.nonzero(inside).flatten(), "amin")  # fmt: skip
        first[at] = True
    extra = [Entry(None if p < 0 else p, v, None if p < 0 or p >= L else float(s[p]), None if p < 0 or p >= L else rank(p),
                   "not_this_request" if p < 0 else "past_bound" if p >= L else "duplicate")
             for v, p in zip(vals[~first][:SHOWN].tolist(), pos[~first][:SHOWN].tolist())]  # fmt: skip
    invalid = int((~first).sum())  # entries past the bound, duplicated, not this request's (SHOWN of them named)
    chosen = pos[first]
    n = scored.noise
    mask = torch.zeros(L, dtype=torch.bool)
    mask[chosen] = True
    lo = float(s[mask].min()) if chosen.numel() else float("inf")  # the worst entry chosen
    hi = float(s[~mask].max()) if L > chosen.numel() else float("-inf")  # the best entry left out
    ok = len(vals) == E and not invalid and hi <= lo + 2 * n
    if ok or kth is None:
        return RequestVerdict(b, ok, E, len(vals), L, n, kth, extra=extra, n_extra=invalid)
    # named: left out though clearly above the k-th best, chosen though clearly below it (one noise:
    # a pair more than 2 noise apart has one of them more than 1 noise from the k-th best)
    miss = ((~mask) & (s > kth + n)).nonzero().flatten()
    below = (mask & (s < kth - n)).nonzero().flatten()
    miss = miss[torch.argsort(s[miss], descending=True)]
    below = below[torch.argsort(s[below])]
    extra += [Entry(int(p), int(p), float(s[p]), rank(int(p)), "below_topk") for p in below[:SHOWN]]
    return RequestVerdict(b, False, E, len(vals), L, n, kth,
                          [Entry(int(p), int(p), float(s[p]), rank(int(p)), "missing") for p in miss[:SHOWN]],
                          extra, int(miss.numel()), invalid + int(below.numel()))  # fmt: skip


@dataclass
class SetJudgement:
    """A call's produced index sets judged: the failing requests' verdicts (all when none fails: empty)."""

    requests: int
    failing: list[RequestVerdict]
    max_noise: float

    @property
    def ok(self) -> bool:
        return not self.failing

    def failing_requests(self) -> list[int]:
        return [v.request for v in self.failing]

    def text(self) -> str:
        if self.ok:
            return f"every request's top-k is right ({self.requests} requests)"
        head = "; ".join(v.text() for v in self.failing[:3])
        more = f"; and {len(self.failing) - 3} more requests" if len(self.failing) > 3 else ""
        return f"{len(self.failing)} of {self.requests} requests chose the wrong entries: {head}{more}"

    def to_json(self) -> dict:
        return {"ok": self.ok, "requests": self.requests, "failing_requests": self.failing_requests(),
                "max_noise": self.max_noise, "failing": [v.to_json() for v in self.failing[:16]]}  # fmt: skip


class Scores:
    """Each request's true logits, computed once and kept (the hypotheses reuse them)."""

    def __init__(self, cap: IndexerCapture, k: float = 2.0):
        self.cap, self.k = cap, k
        self._cache: dict[int, Scored] = {}

    def __getitem__(self, b: int) -> Scored:
        if b not in self._cache:
            self._score(b)
        return self._cache[b]

    def fill(self, requests: Iterable[int]) -> "Scores":
        """The logits of ``requests`` not yet kept, longest first, on torch.get_num_threads()
        single-threaded workers (refmla.blocked.run_units): a request's bits do not depend on it."""
        todo = sorted({b for b in requests if b not in self._cache}, key=lambda b: -int(self.cap.entries[b]))
        run_units(self._score, todo)
        return self

    def _score(self, b: int) -> None:
        self._cache[b] = logits(self.cap, b, TRUE, self.k)


def judge_sets(cap: IndexerCapture, indices: torch.Tensor, scores: Scores) -> SetJudgement:
    """Every request's row of ``indices`` [B, K] judged (judge_request)."""
    scores.fill(range(indices.shape[0]))
    with single_thread():  # a few small ops a request: no thread barrier each
        verdicts = [judge_request(cap, b, indices[b], scores[b]) for b in range(indices.shape[0])]
    for v in verdicts:
        v.label = cap.row_label(v.request) if cap.next_n > 1 else ""
    return SetJudgement(len(verdicts), [v for v in verdicts if not v.ok], max((v.noise for v in verdicts), default=0.0))


__all__ = ["BLOCK", "TRUE", "Entry", "RequestVerdict", "Scored", "Scores", "SetJudgement", "Variant", "judge_request",
           "blocks", "judge_sets", "keys", "logits", "positions"]  # fmt: skip
