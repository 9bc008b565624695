"""The KV bytes read another way than they were written (docs/contract.md section 4): the reference
re-run on the captured bytes decoded the other way, judged by the comparator like every family.

    kv_fp8_encoding_mismatch {"written", "read"}   an fp8 pool read in another encoding than it was
                                                   written: e4m3fn <-> e4m3fnuz (the same byte is
                                                   worth half in e4m3fnuz: keys and values halved or
                                                   doubled, DeepSeek-V4 on MI300X, vLLM #42893 /
                                                   #45681), e5m2. ``written`` is the capture's pool
                                                   dtype, ``read`` the encoding the kernel used
    kv_scale_format {"scale", "stored", "read",    the fp32 dequant scale read as bf16 (its high half:
                     "how", "value_read"}          truncated, or its low half) or as UE8M0 (rounded
                                                   down or up to a power of two, or its first byte as
                                                   an exponent: vLLM #49435)

    kv_page_stride {"stride", "page_stride",       a block table's pages read at another page stride:
                    "cache"}                       page p's token s read at row p * stride_rows + s
                                                   (strides in bytes; half / double the block, another
                                                   block size), on a capture holding the pool
                                                   uncompacted (its pages at their own ids)

Tried before kv_scale_misapplied (encoding) and after it (scale format): halving K and V is no
simpler mistake of the scales, and a scale read as a nearby power of two is not one applied twice.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Iterator, Optional

import torch

from refmla import reference as ref
from refmla.control import capture_control
from refmla.hypotheses.drivers import global_hypothesis, per_request, rescore
from refmla.hypotheses.scalars import full_under, worst_out
from refmla.hypotheses.search import SCREEN, Candidate, Search
from refmla.results import Explanation
from refmla.scales import read_as
from refmla.util import dtype_name

ENCODING = "kv_fp8_encoding_mismatch"
FORMAT = "kv_scale_format"
STRIDE = "kv_page_stride"
BLOCK_SIZES = (16, 32, 64, 128, 256)  # the block sizes engines and kernels assume (vLLM 16, FlashMLA 64, ...)
FP8 = (torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2)


def search_encoding(s: Search) -> Optional[Explanation]:
    kv = s.cap.kv_buffer
    if kv.dtype not in FP8 or s.worst_request is None:
        return None  # screened on the worst request first: two whole-output recomputes at most

    b = s.worst_request
    r = s.req(b)
    if not r.L:
        return None

    def screened(other: torch.dtype) -> bool:
        """The worst request, its own rows decoded as ``other``, within SCREEN of its output."""
        _, kvs = s.own_rows(b)
        read = kvs.contiguous().view(torch.uint8).view(other)  # [L, D]
        exp, _ = s.attend_kv(b, read.double(), read, r.vis)
        return rescore(s, b, exp) < SCREEN

    def candidates() -> Iterator[Candidate]:
        for other in FP8:
            if other == kv.dtype or not screened(other):
                continue
            read = kv.view(torch.uint8).view(other)  # the same bytes, decoded the other way
            cap = copy.copy(s.cap)
            cap.kv_buffer = read
            exp = ref.mla_ref(s.cap.q, read, s.att, s.sc)[0]
            yield Candidate({"written": dtype_name(kv.dtype), "read": dtype_name(other)}, exp,
                            capture_control(cap, s.dtype)[0])  # fmt: skip

    return global_hypothesis(s, ENCODING, candidates())


def search_format(s: Search) -> Optional[Explanation]:
    k, v = s.sc.k_scale, s.sc.v_scale
    if s.cap.kv_buffer.dtype.itemsize != 1 or (k == 1.0 and v == 1.0) or not s.req(s.worst_request).L:
        return None
    guesses = []  # (score, preference, k_used, v_used, detail)
    scopes = [("k_scale and v_scale", k, v)] if k == v else []
    scopes += [("k_scale", k, None), ("v_scale", None, v)]
    for pref, (scope, kx, vx) in enumerate(scopes):
        for read, how, value in read_as(kx if kx is not None else vx):
            k2, v2 = (value if kx is not None else k), (value if vx is not None else v)
            out = worst_out(s, s.sc.sm_scale * k2 / k, s.sc.logit_cap) * (v2 / v)
            detail = {"scale": scope, "stored": "fp32", "read": read, "how": how, "value_read": value}
            guesses.append((rescore(s, s.worst_request, out), pref, k2, v2, detail))
    ok = sorted((g for g in guesses if g[0] <= 1.0), key=lambda g: g[1])
    rest = sorted((g for g in guesses if 1.0 < g[0] < SCREEN), key=lambda g: g[0])

    def candidates() -> Iterator[Candidate]:
        for _, _, k2, v2, detail in ok + rest:
            exp, ctl = full_under(s, dataclasses.replace(s.sc, k_scale=k2, v_scale=v2))
            yield Candidate(detail, exp, ctl, extra={"k_scale": k, "v_scale": v, "k_scale_used": k2, "v_scale_used": v2})

    return global_hypothesis(s, FORMAT, candidates())


def page_strides(page: int) -> list[int]:
    """Strides in rows a kernel may assume for a page of ``page`` rows: half or double it (an element
    size taken for another's: fp8 <-> bf16), a quarter or four times, another common block size."""
    out = [page // 2, page * 2, page // 4, page * 4, *BLOCK_SIZES]
    return [w for w in dict.fromkeys(out) if w >= 1 and w != page]


def search_page_stride(s: Search) -> Optional[Explanation]:
    cap = s.cap
    if cap.block_table is None or cap.orig_kv_indices is not None or cap.meta.page_size < 2:
        return None  # a compacted pool keeps only the table's pages: another stride reads rows it lacks
    return per_request(s, STRIDE, find_page_stride)


def find_page_stride(s: Search, b: int) -> Iterator[Candidate]:
    cap, P = s.cap, s.cap.meta.page_size
    r, N = s.req(b), cap.kv_buffer.shape[0]
    row_bytes = cap.kv_buffer.shape[-1] * cap.kv_buffer.dtype.itemsize
    pos = torch.arange(r.L)
    page = cap.block_table[b].long()[pos // P]  # [L] the page of each position
    cands = []
    for w in page_strides(P):
        rows = page * w + pos % P  # [L] the rows read at stride w
        if not r.L or int(rows.max()) >= N or torch.equal(rows, r.pool_rows):
            continue
        exp, ctl = s.attend_rows(b, rows, r.vis)
        if not bool(torch.isfinite(exp).all()):  # a NaN row read explains any NaN output: no evidence
            continue
        score = rescore(s, b, exp)
        if score < SCREEN:
            cands.append(Candidate({"stride": w * row_bytes, "page_stride": P * row_bytes, "cache": "kv"}, exp, ctl,
                                   score, extra={"stride_rows": w, "page_size": P}))  # fmt: skip
    yield from sorted(cands, key=lambda c: c.score)


__all__ = ["ENCODING", "FORMAT", "STRIDE", "page_strides", "read_as", "search_encoding", "search_format",
           "search_page_stride"]  # fmt: skip
