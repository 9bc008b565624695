"""Faulty outputs written with a plain loop of our own, for measuring refmla's diagnosis.

Nothing here calls refmla's reference, control or hypothesis search (refmla is used only to
read the preset's inputs and to write the capture file): each fault is planted by editing what
the "kernel" reads or writes -- the index list, the pool rows, the output rows, the lse -- and
then computing attention request by request, head by head, with an explicit softmax in fp64
(``attention`` below). So a benchmark over these faults measures the search, not its inverse.

Each PLANTS entry: name -> (function(t, spec, b) -> (out, lse, detail), the hypothesis that
names it, the detail keys the answer must match). ``t`` is the capture's tensors (q,
kv_buffer, kv_indptr, kv_indices, seq_lens, ...), ``b`` the request the fault hits.
"""

from __future__ import annotations

import math
from typing import Callable

import torch


def attention(q, pool, indptr, indices, Dv: int, sm_scale: float, rows=None):
    """out [B, H, Dv], lse [B, H] fp64: for each request, each head, softmax(q . k * sm_scale) . v."""
    B, H, _ = q.shape
    out = torch.zeros(B, H, Dv, dtype=torch.float64)
    lse = torch.full((B, H), -math.inf, dtype=torch.float64)
    for b in range(B) if rows is None else rows:
        slots = indices[int(indptr[b]) : int(indptr[b + 1])].long()
        if len(slots) == 0:
            continue
        k = pool[slots, 0].double()  # [L, D]
        for h in range(H):
            s = (k @ q[b, h].double()) * sm_scale  # [L]
            m = float(s.max())
            p = torch.exp(s - m)
            out[b, h] = (p[:, None] * k[:, :Dv]).sum(0) / p.sum()
            lse[b, h] = m + math.log(float(p.sum()))
    return out, lse


def salient_newest(t, spec, b) -> None:
    """Make request b's newest token one its heads attend to (in a model a decode step's own token
    is). A random newest row among hundreds holds too little softmax mass for any fault in it to be seen."""
    salient_row(t, spec, b, int(t["kv_indices"][int(t["kv_indptr"][b + 1]) - 1]))


def salient_row(t, spec, b, slot: int) -> None:
    """Pool row ``slot`` made one request b's heads attend to: along the mean of b's query heads,
    scaled to a mean logit of 8."""
    m = t["q"][b].double().mean(0)  # [D]
    mean_logit = float((t["q"][b].double() @ m).mean()) * spec.sm_scale
    if mean_logit > 0:
        t["kv_buffer"][slot, 0] = (m * (8.0 / mean_logit)).to(t["kv_buffer"].dtype)


def _clean(t, spec):
    return attention(t["q"], t["kv_buffer"], t["kv_indptr"], t["kv_indices"], spec.kv_lora_rank, spec.sm_scale)


def _page(spec) -> int:
    return spec.page_size if spec.page_size > 1 else 64


def page_missing(t, spec, b):
    """Page 1 of request b (page_size 1: positions 64..127) never arrived: the kernel skips it."""
    P, lo = _page(spec), int(t["kv_indptr"][b])
    idx = torch.cat([t["kv_indices"][: lo + P], t["kv_indices"][lo + 2 * P :]])
    ip = t["kv_indptr"].clone()
    ip[b + 1 :] -= P
    out, lse = attention(t["q"], t["kv_buffer"], ip, idx, spec.kv_lora_rank, spec.sm_scale)
    return out, lse, {"start": P, "end": 2 * P}


def page_missing_faint(t, spec, b):
    """Page 1 of request b never arrived, and its first quarter holds rows b's heads barely attend
    to (mean logit -30: ~1e-16 of the mass), so a range starting a quarter page later fits as well:
    the page-aligned one must be named."""
    P, lo = _page(spec), int(t["kv_indptr"][b])
    m = t["q"][b].double().mean(0)  # [D]
    mean_logit = float((t["q"][b].double() @ m).mean()) * spec.sm_scale
    for slot in t["kv_indices"][lo + P : lo + P + P // 4].tolist():
        t["kv_buffer"][slot, 0] = (m * (-30.0 / mean_logit)).to(t["kv_buffer"].dtype)
    return page_missing(t, spec, b)


def pages_read_off(t, spec, b):
    """Request b reads its page table one page back (page_size 1: one position back)."""
    salient_newest(t, spec, b)
    P, lo, hi = max(1, spec.page_size), int(t["kv_indptr"][b]), int(t["kv_indptr"][b + 1])
    idx = t["kv_indices"].clone()
    idx[lo:hi] = t["kv_indices"][lo - P : hi - P]
    out, lse = attention(t["q"], t["kv_buffer"], t["kv_indptr"], idx, spec.kv_lora_rank, spec.sm_scale)
    return out, lse, {"pages": -1}


def other_rows_read(t, spec, b, salient: bool = True):
    """Page 2 of request b holds page 1 of request 0 (a page reused before its transfer landed).
    At page_size 1 a page is one row: request 0's row is made one b attends to (``salient``), else
    one random row among hundreds may move nothing."""
    P, lo, lo0 = max(1, spec.page_size), int(t["kv_indptr"][b]), int(t["kv_indptr"][0])
    mine = t["kv_indices"][lo + 2 * P : lo + 3 * P].long()
    theirs = t["kv_indices"][lo0 + P : lo0 + 2 * P].long()
    if P == 1 and salient:
        salient_row(t, spec, b, int(theirs[0]))
    pool = t["kv_buffer"].clone()
    pool[mine] = t["kv_buffer"][theirs]
    out, lse = attention(t["q"], pool, t["kv_indptr"], t["kv_indices"], spec.kv_lora_rank, spec.sm_scale)
    return out, lse, {"page": 2, "from_request": 0, "from_page": 1}


def rows_permuted(t, spec, b):
    """The outputs of requests 0 and 1 written to each other's rows."""
    out, lse = _clean(t, spec)
    perm = list(range(out.shape[0]))
    perm[0], perm[1] = 1, 0
    return out[perm], lse[perm], {"rows": {0: 1, 1: 0}}


def newest_kv_zero(t, spec, b):
    """Request b's newest KV row not yet written: zeros where the kernel reads it."""
    salient_newest(t, spec, b)
    pool = t["kv_buffer"].clone()
    pool[int(t["kv_indices"][int(t["kv_indptr"][b + 1]) - 1])] = 0
    out, lse = attention(t["q"], pool, t["kv_indptr"], t["kv_indices"], spec.kv_lora_rank, spec.sm_scale)
    return out, lse, {"how": "zero"}


def seq_len_short(t, spec, b):
    """Request b attends one token less."""
    salient_newest(t, spec, b)
    ip = t["kv_indptr"].clone()
    lo, hi = int(ip[b]), int(ip[b + 1])
    idx = torch.cat([t["kv_indices"][: hi - 1], t["kv_indices"][hi:]])
    ip[b + 1 :] -= 1
    out, lse = attention(t["q"], t["kv_buffer"], ip, idx, spec.kv_lora_rank, spec.sm_scale)
    return out, lse, {"delta": -1}


def sm_scale_twice(t, spec, b):
    """sm_scale applied twice (once folded into q, once in the kernel)."""
    out, lse = attention(t["q"], t["kv_buffer"], t["kv_indptr"], t["kv_indices"], spec.kv_lora_rank,
                         spec.sm_scale * spec.sm_scale)  # fmt: skip
    return out, lse, {}


def kv_zero_block(t, spec, b):
    """Positions 32..95 of request b read as zeros (a block the transfer left unwritten)."""
    pool = t["kv_buffer"].clone()
    lo = int(t["kv_indptr"][b])
    pool[t["kv_indices"][lo + 32 : lo + 96].long()] = 0
    out, lse = attention(t["q"], pool, t["kv_indptr"], t["kv_indices"], spec.kv_lora_rank, spec.sm_scale)
    return out, lse, {"start": 32, "end": 96}


def heads_rotated(t, spec, b):
    """Output head h holds head h + 1 (a head offset off by one)."""
    out, lse = _clean(t, spec)
    return torch.roll(out, -1, dims=1), torch.roll(lse, -1, dims=1), {}


def _fold(H: int, want: int) -> int:
    return want if H % want == 0 and H // want >= 2 else 2


def heads_folded_zero(t, spec, b):
    """Heads folded 2x into pseudo-rows of H/2; the unfold wrote back pseudo-row 0 only: heads H/2.. stay zero."""
    out, lse = _clean(t, spec)
    H = out.shape[1]
    out[:, H // 2 :] = 0
    return out, lse, {"fold": 2, "how": "zero"}


def heads_folded_mixed(t, spec, b):
    """Heads folded 4x (pseudo-rows of H/4 heads); the unfold read pseudo-row p + 1 for p: head h
    written from head h + H/4 (wrapping)."""
    out, lse = _clean(t, spec)
    H = out.shape[1]
    f = _fold(H, 4)
    g = H // f
    mixed = torch.stack([out[:, (h + g) % H] for h in range(H)], 1)
    return mixed, lse, {"fold": f, "how": "mixed"}


def heads_folded_transposed(t, spec, b):
    """Heads folded 2x; the unfold swapped pseudo-row and lane: head h written from head (h % 2) * H/2 + h // 2."""
    out, lse = _clean(t, spec)
    H = out.shape[1]
    return torch.stack([out[:, (h % 2) * (H // 2) + h // 2] for h in range(H)], 1), lse, {"fold": 2, "how": "transposed"}


def heads_folded_duplicated(t, spec, b):
    """Heads folded 8x where the heads allow it (pseudo-rows of H/8 >= 2 heads: 16 heads), else 2x;
    the unfold wrote pseudo-row 0 back to every pseudo-row: head h holds head h % (H / fold)."""
    out, lse = _clean(t, spec)
    H = out.shape[1]
    f = _fold(H, 8)
    g = H // f
    return torch.stack([out[:, h % g] for h in range(H)], 1), lse, {"fold": f, "how": "duplicated"}


def lse_log2(t, spec, b):
    """Request b's final lse written in log2 units (the output is right)."""
    out, lse = _clean(t, spec)
    lse = lse.clone()
    lse[b] = lse[b] / math.log(2)
    return out, lse, {"units": "log2"}


def lse_ln(t, spec, b):
    """Request b's final lse written as lse * ln 2 (ln units where log2 was meant; the output is right)."""
    out, lse = _clean(t, spec)
    lse = lse.clone()
    lse[b] = lse[b] * math.log(2)
    return out, lse, {"units": "ln"}


def whole_request_read(t, spec, b):
    """Request b attends request 0's rows instead of its own (its page table pointed at request 0's
    pages): b's query over request 0's KV."""
    ip, idx = t["kv_indptr"], t["kv_indices"]
    lo0, hi0 = int(ip[0]), int(ip[1])
    ip2 = ip.clone()
    idx2 = torch.cat([idx[: int(ip[b])], idx[lo0:hi0], idx[int(ip[b + 1]) :]])
    ip2[b + 1 :] += (hi0 - lo0) - (int(ip[b + 1]) - int(ip[b]))
    out, lse = attention(t["q"], t["kv_buffer"], ip2, idx2, spec.kv_lora_rank, spec.sm_scale)
    return out, lse, {"from_request": 0}


def kv_swapped(t, spec, b):
    """Requests 0 and b read each other's rows (two requests' KV swapped)."""
    ip, idx = t["kv_indptr"], t["kv_indices"]
    own = [idx[int(ip[r]) : int(ip[r + 1])] for r in range(len(ip) - 1)]
    own[0], own[b] = own[b], own[0]
    ip2 = torch.cat([ip[:1], ip[0] + torch.cumsum(torch.tensor([len(x) for x in own]), 0)]).to(ip.dtype)
    out, lse = attention(t["q"], t["kv_buffer"], ip2, torch.cat(own), spec.kv_lora_rank, spec.sm_scale)
    return out, lse, {"from_request": 0}


def newest_kv_stale(t, spec, b):
    """Request b's newest KV row not yet written: the slot still holds an older token's row, one b
    attends to as well (the salient newest row plus noise of its own size: other values)."""
    salient_newest(t, spec, b)
    pool = t["kv_buffer"].clone()
    slot = int(t["kv_indices"][int(t["kv_indptr"][b + 1]) - 1])
    row = pool[slot, 0].double()
    g = torch.Generator().manual_seed(11)
    noise = torch.randn(row.shape[0], generator=g, dtype=torch.float64)
    pool[slot, 0] = (row + noise * (row.norm() / noise.norm())).to(pool.dtype)
    out, lse = attention(t["q"], pool, t["kv_indptr"], t["kv_indices"], spec.kv_lora_rank, spec.sm_scale)
    return out, lse, {"how": "stale"}


def split_bounds(L: int, n: int) -> list[tuple[int, int]]:
    """SGLang's Triton decode split schedule, written here from its kernel: each split holds
    ceil(ceil(L / n) / 32) * 32 positions; the splits that hold a token."""
    per = -(-(-(-L // n)) // 32) * 32
    return [(a, min(a + per, L)) for a in range(0, L, per)]


def split_partials(t, spec, b) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Request b's stage-1 partials: per split, (normalized out [H, Dv], lse [H]) in fp64."""
    lo, hi = int(t["kv_indptr"][b]), int(t["kv_indptr"][b + 1])
    slots = t["kv_indices"][lo:hi].long()
    n = int(t["num_kv_splits"][b])
    out = []
    for a, e in split_bounds(hi - lo, n):
        o, lse = attention(t["q"][b : b + 1], t["kv_buffer"], torch.tensor([0, e - a]), slots[a:e],
                           spec.kv_lora_rank, spec.sm_scale)  # fmt: skip
        out.append((o[0], lse[0]))
    return out


def merge(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Stage 2: the partials' log-sum-exp merge [H, Dv]."""
    lse = torch.stack([l for _, l in parts], -1)  # [H, S]
    w = torch.exp(lse - lse.max(-1, keepdim=True).values)
    o = torch.stack([o for o, _ in parts], 1)  # [H, S, Dv]
    return (w[..., None] * o).sum(1) / w.sum(-1)[:, None]


def _split_request(t, b: int, least: int = 3) -> int:
    """b, else the first request with at least ``least`` non-empty splits."""
    def count(r):
        L = int(t["kv_indptr"][r + 1] - t["kv_indptr"][r])
        return len(split_bounds(L, int(t["num_kv_splits"][r])))
    return b if count(b) >= least else next(r for r in range(len(t["kv_indptr"]) - 1) if count(r) >= least)


def split_lse_overflow(t, spec, b):
    """Request b's query carries logits up to 120 for its loudest head (a realistic q, CUTLASS
    #2274), and the kernel took each split's lse as log(sum(exp(s))) in fp32 without the max: +inf
    where a split's true lse passes log(fp32 max), and the merge NaN on those (row, head)s."""
    k = t["kv_buffer"][t["kv_indices"][int(t["kv_indptr"][b]) : int(t["kv_indptr"][b + 1])].long(), 0].double()
    top = float((k @ t["q"][b].double().T).max()) * spec.sm_scale  # the largest logit of b
    t["q"][b] = (t["q"][b].double() * (120.0 / top)).to(t["q"].dtype)
    out, lse = _clean(t, spec)
    for h in range(out.shape[1]):
        if any(float(l[h]) >= math.log(torch.finfo(torch.float32).max) for _, l in split_partials(t, spec, b)):
            out[b, h] = math.nan
    return out, lse, {"variant": "split_lse_no_max"}


def pv_accum_bf16(t, spec, b):
    """Every request through a split kernel that accumulates P.V in bf16 (SGLang's Triton stage 1
    with its accumulator in bf16): per split, blocks of 32 positions, an online softmax in fp32, P
    rounded to the value dtype, each block's P.V summed in fp32 and added to a bf16 accumulator;
    the merge in fp32, the output stored in bf16."""
    f32, bf16 = torch.float32, torch.bfloat16
    B, H, _ = t["q"].shape
    Dv = spec.kv_lora_rank
    out = torch.zeros(B, H, Dv, dtype=torch.float64)
    for r in range(B):
        lo, hi = int(t["kv_indptr"][r]), int(t["kv_indptr"][r + 1])
        if hi == lo:
            continue
        k = t["kv_buffer"][t["kv_indices"][lo:hi].long(), 0].to(f32)  # [L, D]
        q = t["q"][r].to(f32)  # [H, D]
        outs, lses = [], []
        for a, e in split_bounds(hi - lo, int(t["num_kv_splits"][r])):
            m = torch.full((H,), -math.inf, dtype=f32)
            l = torch.zeros(H, dtype=f32)
            acc = torch.zeros(H, Dv, dtype=bf16)
            for x in range(a, e, 32):
                y = min(x + 32, e)
                s_ = (q @ k[x:y].T) * spec.sm_scale  # [H, n] fp32
                m2 = torch.maximum(m, s_.amax(-1))
                scale = torch.exp(m - m2)
                p = torch.exp(s_ - m2[:, None])
                pv = p.to(t["kv_buffer"].dtype).to(f32) @ k[x:y, :Dv]  # [H, Dv] fp32
                acc = (acc.to(f32) * scale[:, None] + pv).to(bf16)
                l = l * scale + p.sum(-1)
                m = m2
            outs.append(acc.to(f32) / l[:, None])
            lses.append(m + torch.log(l))
        ls = torch.stack(lses, -1)  # [H, S]
        w = torch.exp(ls - ls.max(-1, keepdim=True).values)
        out[r] = ((w[..., None] * torch.stack(outs, 1)).sum(1) / w.sum(-1)[:, None]).double()
    _, lse = _clean(t, spec)
    return out, lse, {"variant": "pv_accum_bf16"}


def split_repeated(t, spec, b):
    """Request b's split 1 run twice (a work item repeated) and both partials merged."""
    out, lse = _clean(t, spec)
    parts = split_partials(t, spec, b)
    out[b] = merge(parts + [parts[1]])
    a, e = split_bounds(int(t["kv_indptr"][b + 1] - t["kv_indptr"][b]), int(t["num_kv_splits"][b]))[1]
    return out, lse, {"split": 1, "start": a, "end": e}


def split_misrouted(t, spec, b):
    """Request b's split 1 merged into request 0's output instead of b's (a work item routed to the
    neighbouring request's reduce)."""
    out, lse = _clean(t, spec)
    parts = split_partials(t, spec, b)
    mine = split_partials(t, spec, 0)
    out[b] = merge(parts[:1] + parts[2:])
    out[0] = merge(mine + [parts[1]])
    return out, lse, {"request": b, "split": 1, "to_request": 0}


def _partials_at(t, spec, write, read):
    """(out, lse): stage 1 writes partial (r, h, s) at flat row write(r, h, s); stage 2 merges, for
    (r, h), the splits s < n_r read from row read(r, h, s). Rows never written hold no mass."""
    B, H = t["q"].shape[0], t["q"].shape[1]
    parts = [split_partials(t, spec, r) if int(t["kv_indptr"][r + 1] - t["kv_indptr"][r]) else [] for r in range(B)]
    rows: dict[int, tuple[torch.Tensor, float]] = {}
    for r in range(B):
        for s_, (o, l) in enumerate(parts[r]):
            for h in range(H):
                rows[write(r, h, s_)] = (o[h], float(l[h]))
    out, lse = _clean(t, spec)
    for r in range(B):
        for h in range(H):
            got = [rows[read(r, h, s_)] for s_ in range(len(parts[r])) if read(r, h, s_) in rows]
            if not got:
                out[r, h] = 0
                continue
            m = max(l for _, l in got)
            w = torch.tensor([math.exp(l - m) for _, l in got], dtype=torch.float64)
            out[r, h] = (w[:, None] * torch.stack([o for o, _ in got])).sum(0) / w.sum()
    return out, lse


def partials_read_at_split_count(t, spec, b):
    """Stage 1 writes partial (b, h, s) at row (b * H + h) * max_kv_splits + s; stage 2 reads it at
    (b * H + h) * N + s, N the batch's largest num_kv_splits (its stride sized by the split count, not
    the buffer's). Rows never written hold no mass."""
    H, S, N = t["q"].shape[1], spec.max_kv_splits, int(t["num_kv_splits"].max())
    out, lse = _partials_at(t, spec, lambda r, h, s: (r * H + h) * S + s, lambda r, h, s: (r * H + h) * N + s)
    return out, lse, {"stride": N, "axis": "split", "side": "read"}


def partials_written_at_wide_stride(t, spec, b):
    """aiter #3910 (partials written at [0, 16, 32] where [0, 4, 8] is read): stage 1 writes partial
    (b, h, s) at row (b * H + h) * 4 * max_kv_splits + s, stage 2 reads it at the buffer's stride,
    (b * H + h) * max_kv_splits + s: a (request, head) whose flat index is a multiple of 4 merges
    another one's partials, every other reads rows never written."""
    H, S = t["q"].shape[1], spec.max_kv_splits
    out, lse = _partials_at(t, spec, lambda r, h, s: (r * H + h) * 4 * S + s, lambda r, h, s: (r * H + h) * S + s)
    return out, lse, {"stride": 4 * S, "axis": "split", "side": "written"}


def previous_step(t, seed: int = 5) -> dict:
    """The same requests one decode step earlier: each one token shorter (its newest slot not yet
    in its list), the split counts SGLang's default for the shorter lengths, another query; the
    same pool. Returns the previous step's tensors (``out`` left to the caller)."""
    ip, idx = t["kv_indptr"], t["kv_indices"]
    B = len(ip) - 1
    keep, lens = [], []
    for b in range(B):
        lo, hi = int(ip[b]), int(ip[b + 1])
        n = max(0, hi - lo - 1)
        keep.append(idx[lo : lo + n])
        lens.append(n)
    g = torch.Generator().manual_seed(seed)
    prev = {k: v.clone() for k, v in t.items() if k not in ("out", "lse")}
    prev["kv_indices"] = torch.cat(keep)
    prev["kv_indptr"] = torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), dtype=ip.dtype)
    prev["seq_lens"] = torch.tensor(lens, dtype=t["seq_lens"].dtype)
    if "num_kv_splits" in t:
        prev["num_kv_splits"] = torch.tensor([min(16, max(1, n // 128)) for n in lens], dtype=t["num_kv_splits"].dtype)
    prev["q"] = (torch.randn(t["q"].shape, generator=g, dtype=torch.float64) * t["q"].double().std()).to(t["q"].dtype)
    return prev


def stale_metadata(t, spec, prev):
    """Step t's kernel ran with step t-1's metadata (a graph replayed before its metadata was
    updated): step t's queries over step t-1's indptr / indices / split counts."""
    out, lse = attention(t["q"], t["kv_buffer"], prev["kv_indptr"], prev["kv_indices"], spec.kv_lora_rank, spec.sm_scale)
    return out, lse, {"step": 7}


Plant = Callable  # (t, spec, b) -> (out [B, H, Dv], lse [B, H], detail)

# name -> (planter, the hypothesis that names it, detail keys that must match)
PLANTS: dict[str, tuple[Plant, str, tuple]] = {
    "seq_len_short": (seq_len_short, "seq_len_off_by", ("delta",)),
    "newest_kv_zero": (newest_kv_zero, "newest_kv_unwritten", ()),
    "newest_kv_stale": (newest_kv_stale, "newest_kv_unwritten", ("how",)),
    "pages_read_off": (pages_read_off, "pages_read_off", ("pages",)),
    "whole_request_read": (whole_request_read, "other_request_read", ("from_request",)),
    "kv_swapped": (kv_swapped, "other_request_read", ("from_request",)),
    "other_rows_read": (other_rows_read, "other_rows_read", ("page", "from_request", "from_page")),
    "page_missing": (page_missing, "kv_range_missing", ("start", "end")),
    "page_missing_faint": (page_missing_faint, "kv_range_missing", ("start", "end")),
    "kv_zero_block": (kv_zero_block, "kv_range_missing", ()),
    "sm_scale_twice": (sm_scale_twice, "wrong_sm_scale", ()),
    "heads_rotated": (heads_rotated, "head_misaligned", ()),
    "rows_permuted": (rows_permuted, "output_rows_permuted", ("rows",)),
    "heads_folded_zero": (heads_folded_zero, "heads_folded", ("fold", "how")),
    "heads_folded_mixed": (heads_folded_mixed, "heads_folded", ("fold", "how")),
    "heads_folded_transposed": (heads_folded_transposed, "heads_folded", ("fold", "how")),
    "heads_folded_duplicated": (heads_folded_duplicated, "heads_folded", ("fold", "how")),
    "split_lse_overflow": (split_lse_overflow, "numerics", ("variant",)),
    "pv_accum_bf16": (pv_accum_bf16, "numerics", ("variant",)),
    "split_repeated": (split_repeated, "kv_range_repeated", ("split", "start", "end")),
    "split_misrouted": (split_misrouted, "work_item_misrouted", ("request", "split", "to_request")),
    "partials_misaddressed": (partials_read_at_split_count, "partials_misaddressed", ("stride", "axis", "side")),
    "partials_written_wide": (partials_written_at_wide_stride, "partials_misaddressed", ("stride", "axis", "side")),
    "lse_log2": (lse_log2, "lse_units", ("units",)),
    "lse_ln": (lse_ln, "lse_units", ("units",)),
}
