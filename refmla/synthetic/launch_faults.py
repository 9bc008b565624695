"""Faults of a kernel's launch plan (issue 31), planted the way the broken kernel computes them and
registered with the hypothesis that must name each:

    heads_folded_zero    32 -> 16 style head folding (fold 2), only pseudo-row 0 written back:
                         the second half of the heads zero (vLLM #42956)
    heads_folded_mixed   heads folded 4x where the heads allow it (else 2x), unfolded one pseudo-row
                         off: head h holds head h + H / fold (vLLM #46952: cosine 0.69)
    split_repeated       the fault request's split 1 done twice, both partials merged (kv_range_repeated)
    split_misrouted      its split 1 merged into request 0's output instead (work_item_misrouted)
    partials_misaddressed stage 2 reads the partials at split stride N (the batch's largest split
                         count) where stage 1 wrote them at max_kv_splits (aiter #3910)
    split_lse_no_max     q scaled to logits up to 120, each split's lse taken without the max in fp32:
                         +inf, the merge NaN on those (row, head)s (numerics; CUTLASS #2274)
"""

from __future__ import annotations

import math

import torch

from refmla import reference as ref
from refmla.schedule import split_bounds
from refmla.synthetic.faults import Planting, fault


def _fold(p: Planting, want: int) -> int:
    H = p.spec.num_heads
    if H % want == 0 and H // want >= 2:
        return want
    if H % 2 == 0 and H >= 4:
        return 2
    raise ValueError(f"{H} heads cannot be folded with at least 2 heads per pseudo-row")


@fault("heads_folded_zero", "heads folded 2x (H/2 per pseudo-row), only pseudo-row 0 written back: heads H/2.. zero",
       expect="heads_folded")  # fmt: skip
def _heads_folded_zero(p: Planting):
    f = _fold(p, 2)
    out = p.run().clone()
    out[:, p.spec.num_heads // f :] = 0
    return out, {"fold": f, "how": "zero"}


@fault("heads_folded_mixed", "heads folded 4x (2x when H < 8), unfolded one pseudo-row off: head h holds head "
       "h + H/fold", expect="heads_folded")  # fmt: skip
def _heads_folded_mixed(p: Planting):
    H = p.spec.num_heads
    f = _fold(p, 4)
    src = torch.tensor([(h + H // f) % H for h in range(H)])
    return p.run()[:, src], {"fold": f, "how": "mixed"}


def _partials(p: Planting, least: int = 3):
    """(parts [B, H, S, Dv], lses [B, H, S], valid [B, S]) at max_kv_splits; ValueError unless the
    fault request has ``least`` non-empty splits."""
    t, b = p.t, p.request
    if "num_kv_splits" not in t:
        raise ValueError("needs split-KV decode (num_kv_splits); this capture has none")
    parts, lses, valid = ref.mla_decode_split_ref(t["q"], t["kv_buffer"], p.att, t["num_kv_splits"], p.scales,
                                                  max_kv_splits=p.spec.max_kv_splits)  # fmt: skip
    if int(valid[b].sum()) < least:
        raise ValueError(f"request {b} has fewer than {least} non-empty splits")
    return parts, lses, valid


def _bounds(p: Planting, b: int, k: int) -> tuple[int, int]:
    lo, hi = p.bounds(b)
    return split_bounds(hi - lo, int(p.t["num_kv_splits"][b]))[k]  # SGLang's schedule (32-token blocks)


@fault("split_repeated", "split 1 of the fault request done twice, both partials merged", expect="kv_range_repeated")
def _split_repeated(p: Planting):
    parts, lses, valid = _partials(p)
    lses = lses.clone()
    lses[p.request, :, 1] += math.log(2)  # two equal partials: the split weighs double
    a, e = _bounds(p, p.request, 1)
    return ref.merge_splits(parts, lses, valid)[0], {"request": p.request, "split": 1, "start": a, "end": e}


@fault("split_misrouted", "split 1 of the fault request merged into request 0's output instead of its own",
       expect="work_item_misrouted")  # fmt: skip
def _split_misrouted(p: Planting):
    parts, lses, valid = _partials(p)
    b, S = p.request, parts.shape[2]
    if int(valid[0].sum()) >= S:
        raise ValueError("request 0 has no free split slot")
    k0 = int(valid[0].sum())
    parts, lses, valid = parts.clone(), lses.clone(), valid.clone()
    parts[0, :, k0], lses[0, :, k0], valid[0, k0] = parts[b, :, 1], lses[b, :, 1], True
    valid[b, 1] = False
    return ref.merge_splits(parts, lses, valid)[0], {"split": 1, "to_request": 0}


@fault("partials_misaddressed", "stage 1 writes the partials at split stride max_kv_splits, stage 2 reads them "
       "at the batch's largest num_kv_splits", expect="partials_misaddressed")  # fmt: skip
def _partials_misaddressed(p: Planting):
    parts, lses, valid = _partials(p, least=2)
    B, H, S, Dv = parts.shape
    N = int(p.t["num_kv_splits"].max())
    if N >= S:
        raise ValueError(f"the largest split count {N} is the buffer's stride {S}")
    fo = torch.zeros(B * H * S, Dv, dtype=parts.dtype)
    fl = torch.full((B * H * S,), -math.inf, dtype=lses.dtype)
    written = valid[:, None, :].expand(B, H, S)
    fo[written.reshape(-1)], fl[written.reshape(-1)] = parts[written], lses[written]  # row (b * H + h) * S + s
    bi, hi, si = torch.meshgrid(torch.arange(B), torch.arange(H), torch.arange(S), indexing="ij")
    read = ((bi * H + hi) * N + si).clamp(max=B * H * S - 1)
    return ref.merge_splits(fo[read], fl[read], valid)[0], {"stride": N, "axis": "split", "side": "read"}


@fault("split_lse_no_max", "q scaled to logits up to 120; each split's lse taken without the max in fp32: the "
       "merge NaN where it passes 88.7", expect="numerics")  # fmt: skip
def _split_lse_no_max(p: Planting):
    t, b = p.t, p.request
    k = ref.gather(t["kv_buffer"], p.att.group_rows(b), torch.float64)
    top = float((k @ t["q"][b].double().T).max()) * p.spec.sm_scale
    t["q"][b] = (t["q"][b].double() * (120.0 / top)).to(t["q"].dtype)  # the capture's q: the loud one
    parts, lses, valid = _partials(p, least=1)
    over = ((lses >= math.log(torch.finfo(torch.float32).max)) & valid[:, None, :]).any(-1)  # [B, H]
    out = p.run().clone()
    out[over] = math.nan
    return out, {"variant": "split_lse_no_max"}
