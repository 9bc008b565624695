"""empty_split_merged {"split", "num_kv_splits", "went_in"}: an empty split's partial taken into the
merge (aiter #3641, #4420, #4711), decode only, per request.

A request of L tokens run with n splits of per = ceil(ceil(L / n) / 32) * 32 tokens has empty
trailing splits when n * per - L >= per. Their stage-1 partial is never a correct one: e_sum = 0,
so acc / e_sum is 0 / 0 = NaN (what aiter's Gluon kernel stored before #3641), or scratch left
as zero-initialized (partial 0, lse 0). A merge that does not skip them gives:

    NaN partial, lse -inf     exp(-inf) * NaN = NaN: the request's whole output is NaN
    zero partial, lse 0       out = ref * e^lse / (e^lse + k), k empty splits: shrunk toward 0,
                              visible only where the request's lse is small

Both are recomputed from the split schedule (the capture's num_kv_splits, else SGLang's default)
and confirmed on the request's rows. The family is tried before seq_len_off_by: a NaN output is
also what reading one NaN row past the end gives (a synthetic pool's unused rows are NaN), and
when the kernel's own schedule has empty splits those name the mechanism without reading
anything the metadata did not give it (the explanation's note says so).
"""

from __future__ import annotations

import math
from typing import Iterator, Optional

import torch

from refmla import reference as ref
from refmla.hypotheses.drivers import per_request
from refmla.hypotheses.ranges import split_count
from refmla.hypotheses.search import Candidate, Search
from refmla.results import Explanation
from refmla.schedule import nonempty_splits

NAME = "empty_split_merged"
NAN = "NaN partial (0/0 of an empty split), lse -inf"
ZERO = "zero partial, lse 0 (zero-initialized scratch)"


def search(s: Search) -> Optional[Explanation]:
    if not s.cap.is_decode:
        return None
    return per_request(s, NAME, find_empty)


def find_empty(s: Search, b: int) -> Iterator[Candidate]:
    r = s.req(b)
    try:
        n = split_count(s, b)
    except Exception:
        return
    empty = list(range(nonempty_splits(r.L, n, s.cap.split_block), n))  # the trailing splits that hold no token
    if not r.L or not empty:
        return
    source = "capture" if s.cap.num_kv_splits is not None else "SGLang Triton default (computed)"
    extra = {"empty_splits": empty, "schedule": source}
    rows = s.rows_of(b)
    o = s.o64[rows]
    if bool(torch.isnan(o).any()):
        nan = torch.full_like(s.ref[rows], math.nan)
        extra["note"] = "NaN output: reading a NaN row would give the same; the schedule's empty splits name the cause"
        yield Candidate({"split": empty[0], "num_kv_splits": n, "went_in": NAN}, nan, nan.to(s.dtype), extra=extra)
        return
    lse = torch.stack([ref.attend(r.q64[t], r.kv64, s.sc)[1] for t in range(r.T)])  # [T, H]
    shrink = (1.0 / (1.0 + len(empty) * torch.exp(-lse)))[..., None]  # e^lse / (e^lse + k)
    exp, ctl = s.ref[rows] * shrink, (s.ctrl[rows].double() * shrink).to(s.dtype)
    yield Candidate({"split": empty[0], "num_kv_splits": n, "went_in": ZERO}, exp, ctl, extra=extra)
