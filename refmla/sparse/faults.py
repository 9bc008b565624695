"""Production's output for a synthetic sparse call, with a planted fault: a plain loop over each
query row and head, written here on purpose and sharing nothing with :mod:`refmla.sparse.reference`
(the code the diagnosis is measured with), so a test of the search never measures it against itself.

Each fault says what the broken kernel reads; the loop then computes softmax attention over it:

    sink_omitted          the sink left out of the denominator
    sink_twice            exp(sink - max) added twice
    topk_length_ignored   entries past topk_length read in both caches (the stale tails)
    minus_one_as_slot0    every -1 entry (lengths folded into -1, as for aiter_sparse) read as token 0
    page_offset_dropped   each main index read as its page's first token (page * page_size, offset lost)
    extra_cache_ignored   the compressed cache's entries never read
    window_off_by_one     the window one token short at its start (the oldest entry of a full window dropped)
    scale_exponent_off    a UE8M0 exponent off by one on tile 3 of every main key (a factor of 2)
    rope_wrong_bytes      the rope section read 2 bytes early (one bf16 element off)
    scale_exponent_off_extra / _both   the same UE8M0 exponent off on the compressed cache's keys / on both caches'
    wrong_sm_scale        the softmax scale 1/sqrt(576) instead of the given one
    output_rows_permuted  requests 1 and 2 write each other's output rows
    other_rows_read       one main-cache entry of request 2 read at the next slot (:func:`neighbour_entry`)
    kv_fp8_encoding_mismatch / kv_page_stride / kv_scale_format   the cache's bytes read another way
                          (refmla.sparse.byte_faults: V4 read e4m3fnuz, V4 pages at the unpadded stride,
                          V3.2's fp32 tile scales read as UE8M0)

``EXPECT`` says which hypothesis (and detail) a replay must name for each.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch

from refmla.sparse.byte_faults import BYTE_FAULTS, byte_keys
from refmla.sparse.layouts import LAYOUTS
from refmla.sparse.synth import Pool, SparseCase

FAULT_TILE = 3


def _entries(case: SparseCase, fault: Optional[str], b: int) -> list[torch.Tensor]:
    """The keys [n, D] fp64 row b reads from each cache under ``fault``."""
    out = []
    scopes = [(case.main, case.indices, case.topk_length, 0)]
    if case.extra is not None:
        scopes.append((case.extra, case.extra_indices, case.extra_topk_length, 1))
    for pool, idx, lengths, pid in scopes:
        if fault == "extra_cache_ignored" and pid == 1:
            continue
        row = idx[b, 0].tolist()
        n = int(lengths[b])
        if fault == "topk_length_ignored":
            n = len(row)
        picked = [t for t in row[:n] if t != -1]
        if fault == "minus_one_as_slot0":
            picked = [0 if t == -1 or k >= n else t for k, t in enumerate(row)]
        if fault == "window_off_by_one" and pid == 0 and case.preset.window and n == case.preset.window:
            picked = picked[1:]
        if fault == "page_offset_dropped" and pid == 0:
            picked = [t // pool.page_size * pool.page_size for t in picked]
        moved = neighbour_entry(case) if fault == "other_rows_read" and pid == 0 else None
        if moved is not None and moved[0] == b:
            picked = [moved[3] if k == moved[1] else t for k, t in zip(_listed(row, n), picked)]
        if fault in BYTE_FAULTS and (pid == 0 or fault == "kv_fp8_encoding_mismatch"):  # an encoding: both caches
            out.append(byte_keys(pool, picked, fault))
            continue
        scaled = fault == "scale_exponent_off" and pid == 0 or fault == "scale_exponent_off_extra" and pid == 1
        out.append(_keys(pool, picked, "scale_exponent_off" if scaled or fault == "scale_exponent_off_both" else
                         (fault if pid == 0 else None)))  # fmt: skip
    return out


def _listed(row: list, n: int) -> list[int]:
    """The positions in an index list of the entries read (not -1, before the length)."""
    return [k for k, t in enumerate(row[:n]) if t != -1]


def neighbour_entry(case: SparseCase) -> Optional[tuple[int, int, int, int]]:
    """(request, position in its main index list, slot meant, slot read): the first entry of request 2
    (else the last request) from position 5 on whose next slot holds a written token."""
    b = min(2, case.q.shape[0] - 1)
    row, n = case.indices[b, 0].tolist(), int(case.topk_length[b])
    finite = torch.isfinite(case.main.values).all(dim=1)
    for k in _listed(row, n)[5:] or _listed(row, n):
        t = row[k]
        if t + 1 < finite.shape[0] and bool(finite[t + 1]):
            return b, k, t, t + 1
    return None


def _keys(pool: Pool, tokens: list[int], fault: Optional[str]) -> torch.Tensor:
    L = LAYOUTS[pool.layout]
    k = pool.values[torch.tensor(tokens, dtype=torch.long)].clone() if tokens else torch.zeros(0, L.head_dim, dtype=torch.float64)
    if fault == "scale_exponent_off":
        k[:, FAULT_TILE * L.tile : (FAULT_TILE + 1) * L.tile] *= 2.0
    if fault == "rope_wrong_bytes":
        for i, t in enumerate(tokens):
            k[i, L.d_nope :] = _rope_at(pool, t, -2)
    return k


def _rope_at(pool: Pool, token: int, offset: int) -> torch.Tensor:
    """The 64 bf16 values at the rope section's bytes shifted by ``offset`` (read from the page bytes)."""
    L = LAYOUTS[pool.layout]
    p, s = divmod(token, pool.page_size)
    start = (s * L.data_bytes if L.block_split else s * L.bytes_per_token + L.scale_bytes) + L.d_nope + offset
    raw = bytes(pool.pages[p, start : start + 2 * L.d_rope].tolist())
    return torch.frombuffer(bytearray(raw), dtype=torch.bfloat16).to(torch.float64)


def planted_output(case: SparseCase, fault: Optional[str] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, 1, H, Dv] bf16, lse [B, 1, H] fp32) of a kernel with ``fault`` (None: a correct one)."""
    p = case.preset
    B, _, H, D = case.q.shape
    out = torch.zeros(B, 1, H, p.head_dim_v, dtype=torch.float64)
    lse = torch.zeros(B, 1, H, dtype=torch.float64)
    sinks = {"sink_omitted": 0, "sink_twice": 2}.get(fault or "", 1)
    scale = 576**-0.5 if fault == "wrong_sm_scale" else p.softmax_scale
    for b in range(B):
        keys = torch.cat(_entries(case, fault, b), dim=0)  # [n, D]
        for h in range(H):
            q = case.q[b, 0, h].to(torch.float64)
            if keys.shape[0] == 0:
                lse[b, 0, h] = math.inf  # lonely: out stays 0
                continue
            s = scale * (keys @ q)  # [n] this head's logits
            m = float(s.max())
            w = torch.exp(s - m)
            denom = float(w.sum())
            if case.sink is not None:
                denom += sinks * math.exp(float(case.sink[h]) - m)
            out[b, 0, h] = (w[:, None] * keys[:, : p.head_dim_v]).sum(0) / denom
            lse[b, 0, h] = m + math.log(float(w.sum()))
    if fault == "output_rows_permuted":
        out[[1, 2]], lse[[1, 2]] = out[[2, 1]], lse[[2, 1]]
    return out.to(torch.bfloat16), lse.to(torch.float32)


FAULTS: dict[str, str] = {
    "sink_omitted": "the attention sink left out of the denominator",
    "sink_twice": "the attention sink added twice",
    "topk_length_ignored": "entries past topk_length read in both caches (the stale tails of the index lists)",
    "minus_one_as_slot0": "-1 entries read as token 0",
    "page_offset_dropped": "each index read as its page's first token (page * page_size, the offset lost)",
    "extra_cache_ignored": "the extra (compressed) cache never read",
    "window_off_by_one": "the window one token short at its start",
    "scale_exponent_off": f"a UE8M0 exponent off by one on tile {FAULT_TILE} (a factor of 2)",
    "rope_wrong_bytes": "the rope section read 2 bytes early",
    "scale_exponent_off_extra": f"a UE8M0 exponent off by one on tile {FAULT_TILE} of the compressed cache's keys",
    "scale_exponent_off_both": f"a UE8M0 exponent off by one on tile {FAULT_TILE} of both caches' keys",
    "wrong_sm_scale": "the softmax scale 1/sqrt(576) instead of the given one",
    "output_rows_permuted": "requests 1 and 2 write each other's output rows",
    "other_rows_read": "one main-cache entry of request 2 read at the next slot",
    "kv_fp8_encoding_mismatch": "V4: the caches' e4m3fn bytes read as e4m3fnuz (MI300X's encoding)",
    "kv_page_stride": "V4: the main cache's pages read at the unpadded stride (page_size * 584 bytes)",
    "kv_scale_format": "V3.2 with fp32 tile scales (deepseek-v3.2-tp8-sglang): each read as UE8M0, rounded down",
}
# fault -> (the hypothesis a replay names, its detail; None: whatever the data decides, checked by the test)
EXPECT: dict[str, tuple[str, Optional[dict]]] = {
    **{f: (f, None) for f in ("sink_omitted", "sink_twice", "minus_one_as_slot0", "page_offset_dropped",
                              "extra_cache_ignored", "output_rows_permuted", "other_rows_read")},
    "topk_length_ignored": ("topk_length_ignored", None),
    "window_off_by_one": ("window_off_by_one", {"delta": -1, "side": "start"}),
    "rope_wrong_bytes": ("rope_wrong_bytes", {"offset": -2}),
    "scale_exponent_off": ("scale_exponent_off", {"tile": FAULT_TILE, "factor": 2.0, "cache": "main"}),
    "scale_exponent_off_extra": ("scale_exponent_off", {"tile": FAULT_TILE, "factor": 2.0, "cache": "extra"}),
    "scale_exponent_off_both": ("scale_exponent_off", {"tile": FAULT_TILE, "factor": 2.0, "cache": "both"}),
    "wrong_sm_scale": ("wrong_sm_scale", None),
    "kv_fp8_encoding_mismatch": ("kv_fp8_encoding_mismatch", {"written": "float8_e4m3fn", "read": "float8_e4m3fnuz"}),
    "kv_page_stride": ("kv_page_stride", None),  # the strides: the preset's page size
    "kv_scale_format": ("kv_scale_format", {"stored": "fp32", "read": "ue8m0", "cache": "main",
                                            "how": "its exponent (rounded down to a power of two)"}),
}
APPLIES: dict[str, Callable[[SparseCase], bool]] = {
    "sink_omitted": lambda c: c.sink is not None,
    "sink_twice": lambda c: c.sink is not None,
    "extra_cache_ignored": lambda c: c.extra is not None,
    "window_off_by_one": lambda c: c.preset.window is not None,
    "scale_exponent_off": lambda c: LAYOUTS[c.preset.kv_layout].scale_kind == "ue8m0",
    "scale_exponent_off_extra": lambda c: c.extra is not None and LAYOUTS[c.preset.kv_layout].scale_kind == "ue8m0",
    "scale_exponent_off_both": lambda c: c.extra is not None and LAYOUTS[c.preset.kv_layout].scale_kind == "ue8m0",
    "output_rows_permuted": lambda c: c.q.shape[0] >= 3,
    # V3.2: one entry of ~300 moves the output within noise and only the lse fails; the search reads the output
    "other_rows_read": lambda c: c.extra is not None and neighbour_entry(c) is not None,
    "kv_fp8_encoding_mismatch": lambda c: c.preset.kv_layout == "v4",
    "kv_page_stride": lambda c: c.preset.kv_layout == "v4",
    "kv_scale_format": lambda c: c.preset.kv_layout == "v32" and c.preset.scales == "amax",
}


__all__ = ["APPLIES", "EXPECT", "FAULTS", "neighbour_entry", "planted_output"]
