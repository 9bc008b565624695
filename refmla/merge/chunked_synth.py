"""Synthetic chunked-prefix prefills with a planted fault (``refmla synth OUT --preset
chunked-prefill --fault chunk_missing_block``): random q, new keys and a cached prefix cut into
chunks the way SGLang cuts it (chunk length = capacity / requests, the last chunks of a shorter
prefix empty), every piece's attention and every merge computed by this module's own plain loop
over (row, head) -- never refmla's reference -- the documented way or with the fault.

Faults: none; chunk_missing_block (request 0's chunk 1 attended without its last 8 keys);
chunk_other_request (request 1's chunk 0 attended over request 0's keys of that chunk);
empty_lse_zero (request 1's empty last chunk returned, and merged, with lse 0 instead of -inf);
chunk_dropped (chunk 1 left out of its merge: step 1 passes the earlier merge on); lse_base (lse
in log2 merged as ln: on a base-e preset the attention returned log2 lse to the natural-log merge,
on the base-2 preset the merge read the documented log2 lse as natural).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from refmla.merge.io import write_chunked
from refmla.merge.synth import plain_merge
from refmla.util import check_choice

FAULTS = ("none", "chunk_missing_block", "chunk_other_request", "empty_lse_zero", "chunk_dropped", "lse_base")
MISSING = 8  # keys chunk_missing_block leaves out


@dataclass(frozen=True)
class ChunkedSpec:
    name: str
    merger: str
    lse_base: str  # the base every lse of the capture is documented in
    prefix_lens: tuple = (40, 23)
    extend_lens: tuple = (5, 3)
    chunk_len: int = 16  # SGLang: SGLANG_MAX_KV_CHUNK_CAPACITY // batch size
    heads: int = 4
    qk_dim: int = 48  # DeepSeek's 128 nope + 64 rope, scaled down
    v_dim: int = 32


PRESETS = {
    "chunked-prefill": ChunkedSpec("chunked-prefill", "sglang.merge_state", "e"),
    "chunked-prefill-log2": ChunkedSpec("chunked-prefill-log2", "flashinfer.merge_state", "2"),
}


def _plain_attention(q, k, v, scale: float, causal: bool, base: str) -> tuple[torch.Tensor, torch.Tensor]:
    """q [R, H, Dq] over k, v [L, H, *], one (row, head) at a time in fp64; causal: row j sees
    keys 0..L-R+j. Returns out [R, H, Dv] (0 where no key) and lse [R, H] in ``base`` (-inf)."""
    R, H, L = q.shape[0], q.shape[1], k.shape[0]
    out, lse = torch.zeros(R, H, v.shape[-1], dtype=torch.float64), torch.full((R, H), -math.inf, dtype=torch.float64)
    for j in range(R):
        seen = L - R + j + 1 if causal else L
        for h in range(H):
            s = [scale * float(torch.dot(q[j, h].double(), k[n, h].double())) for n in range(seen)]
            if not s:
                continue
            m = max(s)
            w = [math.exp(x - m) for x in s]
            out[j, h] = sum(wn * v[n, h].double() for n, wn in enumerate(w)) / sum(w)
            lse[j, h] = (m + math.log(sum(w))) / (math.log(2.0) if base == "2" else 1.0)
    return out, lse


def _layout(s: ChunkedSpec) -> tuple[torch.Tensor, torch.Tensor]:
    C = max(math.ceil(p / s.chunk_len) for p in s.prefix_lens)
    starts = torch.arange(C)[:, None].expand(C, len(s.prefix_lens)) * s.chunk_len
    lens = (torch.minimum(torch.tensor(s.prefix_lens)[None], starts + s.chunk_len) - starts).clamp(min=0)
    return starts.int().contiguous(), lens.int()


def synth_chunked(out: Any, preset: str, fault: str = "none", seed: int = 0) -> dict:
    """Write one chunked-prefill capture; returns what was planted."""
    check_choice("chunked-prefill preset", preset, PRESETS)
    check_choice("chunked-prefill fault", fault, FAULTS)
    s = PRESETS[preset]
    g = torch.Generator().manual_seed(seed)
    B, T, H, bf = len(s.prefix_lens), sum(s.extend_lens), s.heads, torch.bfloat16
    scale = 1.0 / math.sqrt(s.qk_dim)
    starts, lens = _layout(s)
    C, N = lens.shape[0], int(lens.sum())
    q, new_k = (torch.randn(T, H, s.qk_dim, generator=g).to(bf) for _ in range(2))
    new_v = torch.randn(T, H, s.v_dim, generator=g).to(bf)
    chunk_k, chunk_v = torch.randn(N, H, s.qk_dim, generator=g).to(bf), torch.randn(N, H, s.v_dim, generator=g).to(bf)
    qo = [0, *torch.cumsum(torch.tensor(s.extend_lens), 0).tolist()]
    offs = [0, *torch.cumsum(lens.sum(1), 0).tolist()]
    returned = "2" if fault == "lse_base" and s.lse_base == "e" else s.lse_base  # the attention's lse base
    merged_as = "e" if fault == "lse_base" else s.lse_base  # the base the merge reads its lse in
    planted: dict = {"fault": fault}

    def attend_all(keys_of, causal: bool):
        o, l = torch.zeros(T, H, s.v_dim, dtype=torch.float64), torch.full((T, H), -math.inf, dtype=torch.float64)
        for b in range(B):
            k, v = keys_of(b)
            o[qo[b]:qo[b + 1]], l[qo[b]:qo[b + 1]] = _plain_attention(q[qo[b]:qo[b + 1]], k, v, scale, causal, returned)
        return o.to(bf), l.float()

    def chunk_keys(i: int, b: int) -> slice:
        a = offs[i] + int(lens[i, :b].sum())
        return slice(a, a + int(lens[i, b]))

    new_out, new_lse = attend_all(lambda b: (new_k[qo[b]:qo[b + 1]], new_v[qo[b]:qo[b + 1]]), True)
    chunk_out, chunk_lse = [], []
    for i in range(C):
        def keys_of(b: int, i: int = i):
            sl = chunk_keys(i, b)
            if fault == "chunk_missing_block" and (i, b) == (1, 0):
                sl = slice(sl.start, sl.stop - MISSING)
                planted.update(chunk=1, request=0, missing=MISSING)
            if fault == "chunk_other_request" and (i, b) == (0, 1):
                sl = chunk_keys(0, 0)
                planted.update(chunk=0, request=1, read_request=0)
            return chunk_k[sl], chunk_v[sl]

        o, l = attend_all(keys_of, False)
        if fault == "empty_lse_zero" and i == C - 1:
            empty = (lens[i] == 0).nonzero()[:, 0].tolist()
            for b in empty:
                l[qo[b]:qo[b + 1]] = 0.0
            planted.update(chunk=i, requests=empty)
        chunk_out.append(o), chunk_lse.append(l)
    acc, acc_lse, steps = new_out, new_lse, []
    for i in range(C):
        if fault == "chunk_dropped" and i == 1:
            m_out, m_lse = acc.double(), acc_lse.double()
            planted.update(chunk=1)
        else:
            m_out, m_lse = plain_merge(chunk_out[i], chunk_lse[i], acc, acc_lse, merged_as)
        acc, acc_lse = m_out.to(bf), m_lse.float()
        steps.append((acc, acc_lse))
    t = {"q": q, "new_k": new_k, "new_v": new_v, "new_out": new_out, "new_lse": new_lse, "chunk_k": chunk_k,
         "chunk_v": chunk_v, "chunk_out": torch.stack(chunk_out), "chunk_lse": torch.stack(chunk_lse),
         "out": acc, "lse": acc_lse, "extend_lens": torch.tensor(s.extend_lens, dtype=torch.int32),
         "prefix_lens": torch.tensor(s.prefix_lens, dtype=torch.int32), "chunk_starts": starts, "chunk_lens": lens}  # fmt: skip
    if C > 1:
        t["step_out"], t["step_lse"] = torch.stack([o for o, _ in steps[:-1]]), torch.stack([l for _, l in steps[:-1]])
    meta = {"mode": "chunked_prefill", "merger": s.merger, "lse_base": s.lse_base, "sm_scale": scale, "engine": "synth",
            "attention": "synth.plain_loop", "layer_id": 0, "tp_rank": 0, "step": 0}  # fmt: skip
    write_chunked(out, t, meta)
    return planted


__all__ = ["FAULTS", "PRESETS", "ChunkedSpec", "synth_chunked"]
