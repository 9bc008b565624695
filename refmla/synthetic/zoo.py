"""A zoo of faults taken from real bugs in real MLA kernels (issue 11, part 3), each planted the way
the broken kernel computes it and registered with the hypothesis that must name it.

    last_page_read_full     page_size > 1: the last page read as full (aiter #2996, #3095)
    last_page_len_swapped   the last page's length taken from another request's kv_last_page_len
    empty_split_merged      an empty split's NaN partial taken into the merge (aiter #3641, #4420, #4711)
    offset_overflow         a 32-bit KV byte offset wrapping past 2^32 reads another row (aiter #5765)
    k_scale_twice           fp8 pool: k_scale applied twice (planted on an fp8 version of the preset)
    v_scale_missing         fp8 pool: v_scale never applied
    rope_ignored            q . k over the latent dims only
    rope_swapped            q's latent and rope parts swapped against the cache's

Rows a correct kernel never reads are NaN in a synthetic pool (refmla.synthetic.inputs); a broken
kernel that reads them in production reads whatever a previous request left there, so the faults
below first write such stale (finite) rows where they read them.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from refmla import reference as ref
from refmla.schedule import nonempty_splits
from refmla.synthetic.faults import Planting, fault
from refmla.synthetic.spec import SynthSpec


def _lens(p: Planting) -> list[int]:
    return [p.bounds(b)[1] - p.bounds(b)[0] for b in range(len(p.t["kv_indptr"]) - 1)]


def _slots(p: Planting, b: int) -> torch.Tensor:
    lo, hi = p.bounds(b)
    return p.t["kv_indices"][lo:hi].long()


def _need_pages(p: Planting) -> int:
    P = p.spec.page_size
    if P < 2:
        raise ValueError(f"page faults need page_size > 1 (preset {p.spec.name} has {P}); "
                         "use e.g. --preset kimi-k2-tp8-page256")  # fmt: skip
    return P


def _stale(p: Planting, slots: torch.Tensor) -> None:
    """Write stale, finite rows (a previous occupant's KV) at pool ``slots``."""
    kvb = p.t["kv_buffer"]
    g = torch.Generator().manual_seed(p.spec.seed + 1234)
    rows = torch.randn(len(slots), kvb.shape[-1], generator=g)
    if kvb.dtype.itemsize == 1:
        rows = rows / p.spec.k_scale
    kvb = kvb.clone()
    kvb[slots, 0] = rows.to(kvb.dtype)
    p.t["kv_buffer"] = kvb


def _with_rows(p: Planting, b: int, seq: torch.Tensor) -> torch.Tensor:
    """The reference with request b attending pool rows ``seq`` (in position order) instead of its own."""
    t, lo, hi = p.t, *p.bounds(b)
    idx = torch.cat([t["kv_indices"][:lo].long(), seq, t["kv_indices"][hi:].long()])
    indptr = t["kv_indptr"].clone()
    indptr[b + 1 :] += len(seq) - (hi - lo)
    return p.run(indptr=indptr, idx=idx)


def _partial_request(p: Planting, P: int) -> int:
    """The fault request when its last page is partial, else the request with the most tail rows."""
    lens = _lens(p)
    if lens[p.request] % P:
        return p.request
    tails = [(P - L % P if L % P else 0, -b) for b, L in enumerate(lens)]
    n, b = max(tails)
    if n == 0:
        raise ValueError(f"no request of preset {p.spec.name} has a partial last page (page_size {P})")
    return -b


@fault("last_page_read_full", "page_size > 1: the kernel read the last page as full, page_size * ceil(L / page_size) "
       "rows, the tail rows holding stale KV (aiter #2996, #3095)")  # fmt: skip
def _last_page_read_full(p: Planting):
    P = _need_pages(p)
    b = _partial_request(p, P)
    slots = _slots(p, b)
    L, last = len(slots), int(slots[-1])
    tail = torch.arange(last + 1, (last // P + 1) * P)  # the rest of the last page
    _stale(p, tail)
    out = _with_rows(p, b, torch.cat([slots, tail]))
    return out, {"request": b, "page": (L - 1) // P, "rows_read": L + len(tail), "rows_expected": L}


@fault("last_page_len_swapped", "page_size > 1: the last page's length taken from the next request's "
       "kv_last_page_len (an indexing slip; aiter #2996, #3095)")  # fmt: skip
def _last_page_len_swapped(p: Planting):
    P = _need_pages(p)
    lens = _lens(p)
    B, b = len(lens), p.request
    last_len = [L - ((L - 1) // P) * P if L else 0 for L in lens]
    other = next((o for o in [(b + k) % B for k in range(1, B)] if last_len[o] and abs(last_len[o] - last_len[b]) > 4),
                 None)  # fmt: skip
    if other is None or not lens[b]:
        raise ValueError(f"preset {p.spec.name}: no other request's last page length differs from request {b}'s by > 4")
    slots = _slots(p, b)
    L, first = lens[b], int(slots[((lens[b] - 1) // P) * P])  # first slot of the last page
    n = L - last_len[b] + last_len[other]  # rows the kernel attended
    seq = slots[:n]
    if n > L:
        seq = torch.cat([slots, torch.arange(first + last_len[b], first + last_len[other])])
        _stale(p, seq[L:])
    return _with_rows(p, b, seq), {"request": b, "from_request": other, "last_page_len": last_len[other],
                                   "rows_read": n, "rows_expected": L}  # fmt: skip


# --------------------------------------------------------------------------------------------
# Empty splits merged (aiter #3641, #4420, #4711)
# --------------------------------------------------------------------------------------------


def _empty_split_request(p: Planting, n: int) -> int:
    """The fault request when it has an empty split under n splits, else the first request that does."""
    lens = _lens(p)
    order = [p.request] + [b for b in range(len(lens)) if b != p.request]
    for b in order:
        if lens[b] and nonempty_splits(lens[b], n) < n:
            return b
    raise ValueError(f"preset {p.spec.name}: no request has an empty split under {n} splits")


@fault("empty_split_merged", "a request run with max_kv_splits splits, some of them empty, whose 0/0 (NaN) partial "
       "the merge takes in: the request's output is NaN (aiter #3641, #4420, #4711)")  # fmt: skip
def _empty_split_merged(p: Planting):
    t, n = p.t, p.spec.max_kv_splits
    if "num_kv_splits" not in t:
        raise ValueError(f"preset {p.spec.name} is an extend capture: splits are a decode kernel's")
    b = _empty_split_request(p, n)
    splits = t["num_kv_splits"].clone()
    splits[b] = n  # the kernel ran this request with the fixed maximum, as the capture records
    t["num_kv_splits"] = splits
    parts, lses, valid = ref.mla_decode_split_ref(t["q"], t["kv_buffer"], p.att, splits, p.scales, max_kv_splits=n)
    empty = [s for s in range(n) if not bool(valid[b, s])]
    parts[b, :, empty] = math.nan  # stage 1 of an empty split: acc / e_sum = 0 / 0
    valid = valid.clone()
    valid[b, empty] = True  # ... and the merge does not skip it: exp(-inf) * NaN = NaN
    out = ref.merge_splits(parts, lses, valid)[0]
    return out, {"request": b, "split": empty[0], "empty_splits": empty, "num_kv_splits": n}


# --------------------------------------------------------------------------------------------
# 32-bit offset overflow (aiter #5765, #2768)
# --------------------------------------------------------------------------------------------


@fault("offset_overflow", "the fault request's last pages sit past slot 2^32 / (576 * itemsize) of a large pool "
       "(physical slots in orig_kv_indices) and the kernel's uint32 byte offset wraps: they read the bytes at "
       "the wrapped address, another request's rows (aiter #5765)")  # fmt: skip
def _offset_overflow(p: Planting):
    t, b, P = p.t, p.request, p.spec.page_size
    lens = _lens(p)
    host = max((o for o in range(len(lens)) if o != b), key=lambda o: lens[o])  # what the wrap reads
    L, n_target = lens[b], min(lens[b] // 2, 300, lens[host] - P - 2)
    u8 = t["kv_buffer"][:, 0].view(torch.uint8)  # [N, rb]
    rb = u8.shape[-1]
    first = -(-(2**32) // rb)  # the first slot whose byte offset wraps
    p_w = -(-(L - n_target) // P) * P  # positions [p_w, L) sit in pages past the wrap
    if n_target < 1 or p_w >= L:
        raise ValueError(f"preset {p.spec.name}: request {b} or {host} is too short to place past the wrap")
    below = (first - p_w) // P * P - P  # pages of positions [0, p_w): just under the wrap
    above = -(-(first + P) // P) * P  # pages of positions [p_w, L): past it, reading slots P.. (not 0)
    phys = t["kv_indices"].long() + 2**20  # everyone else: away from both
    (lo, hi), (hlo, hhi) = p.bounds(b), p.bounds(host)
    phys[hlo:hhi] = P + torch.arange(lens[host])  # the host request at slots P.. (slot 0 is SGLang's padding)
    phys[lo:hi] = torch.cat([below + torch.arange(p_w), above + torch.arange(L - p_w)])
    t["orig_kv_indices"] = phys
    # what the kernel read: the bytes at the wrapped offset, i.e. parts of the host request's rows
    slots = phys[lo:hi]
    wrapped = slots >= first
    off = slots[wrapped] * rb % 2**32
    host_rows = t["kv_indices"][hlo:hhi].long()
    read = torch.empty(len(off), rb, dtype=torch.uint8)
    for i, (r0, k) in enumerate(zip((off // rb - P).tolist(), (off % rb).tolist())):  # host position r0
        read[i] = torch.cat([u8[host_rows[r0], k:], u8[host_rows[r0 + 1], :k]])
    N = t["kv_buffer"].shape[0]
    kvb = torch.cat([t["kv_buffer"], read.view(t["kv_buffer"].dtype)[:, None]])
    seq = t["kv_indices"][lo:hi].long().clone()
    seq[wrapped] = torch.arange(N, N + len(off))
    idx = torch.cat([t["kv_indices"][:lo].long(), seq, t["kv_indices"][hi:].long()])
    pos = int(torch.nonzero(wrapped)[0])
    return p.run(kvb=kvb, idx=idx), {"request": b, "first_slot": int(slots[pos]), "position": pos,
                                     "wrapped_positions": int(wrapped.sum()), "first_wrapping_slot": first}  # fmt: skip


# --------------------------------------------------------------------------------------------
# fp8 pool: k_scale / v_scale applied twice or not at all
# --------------------------------------------------------------------------------------------

FP8_SCALE = 0.5  # the dequant scale of the fp8 pool these faults are planted on


def fp8_pool(spec: SynthSpec) -> SynthSpec:
    """The spec with an fp8 e4m3fn pool and k_scale = v_scale = FP8_SCALE (kept if already fp8 and scaled)."""
    if spec.kv_dtype.itemsize == 1 and (spec.k_scale != 1.0 or spec.v_scale != 1.0):
        return spec
    return dataclasses.replace(spec, name=f"{spec.name}-fp8", kv_dtype=torch.float8_e4m3fn,
                               k_scale=FP8_SCALE, v_scale=FP8_SCALE)  # fmt: skip


def _need_scales(p: Planting) -> None:
    if p.spec.k_scale == 1.0 or p.spec.v_scale == 1.0:
        raise ValueError(f"spec {p.spec.name}: the scale faults need k_scale and v_scale != 1 "
                         "(synth_capture plants them on refmla.synthetic.faults.spec_for(spec, fault))")  # fmt: skip


@fault("k_scale_twice", "fp8 pool: the kernel applied k_scale twice (dequantized K, then scaled the logits by "
       "k_scale again)", expect="kv_scale_misapplied", spec=fp8_pool)  # fmt: skip
def _k_scale_twice(p: Planting):
    _need_scales(p)
    k = p.spec.k_scale
    return p.run(k_scale=k * k), {"scale": "k_scale", "applied": "twice", "k_scale": k, "pool": p.spec.name}


@fault("v_scale_missing", "fp8 pool: the kernel never applied v_scale to the output", expect="kv_scale_misapplied",
       spec=fp8_pool)  # fmt: skip
def _v_scale_missing(p: Planting):
    _need_scales(p)
    return p.run(v_scale=1.0), {"scale": "v_scale", "applied": "not at all", "v_scale": p.spec.v_scale,
                                "pool": p.spec.name}  # fmt: skip


# --------------------------------------------------------------------------------------------
# The rope part of q . k
# --------------------------------------------------------------------------------------------


@fault("rope_ignored", "q . k over the 512 latent dims only: the rope part (64 dims) left out", expect="rope_mishandled")
def _rope_ignored(p: Planting):
    q = p.t["q"].clone()
    q[..., p.spec.kv_lora_rank :] = 0
    return p.run(q=q), {"how": "rope ignored"}


@fault("rope_swapped", "q concatenated as [q_pe, q_nope] against a cache stored [c_kv, k_pe]: latent and rope "
       "swapped in q . k", expect="rope_mishandled")  # fmt: skip
def _rope_swapped(p: Planting):
    q, Dv = p.t["q"], p.spec.kv_lora_rank
    return p.run(q=torch.cat([q[..., Dv:], q[..., :Dv]], -1)), {"how": "q rope and latent swapped"}
