"""Planted faults of the speculative verify path (issue 13), registered with the other faults.

Each is the fp64 reference under the fault, on a ``verify`` capture (presets kimi-k2-tp8-mtp*,
kimi-k2-tp8-eagle-tree), and names the hypothesis of :mod:`refmla.hypotheses.verify` that must
explain it:

    causal_top_left      query i of n sees positions 0..i (top-left) instead of 0..L-n+i
    qlen_pow2_padding    the kernel pads qlen n to the next power of two Q and reads request b's
                         query i at row b*Q + i (another request's query, or nothing past the end)
    mask_wrong_request   request b's drafts see each other through request b+1's tree mask
    draft_kv_missing     the drafts' KV rows were not in the pool when the kernel ran (read as zeros)
"""

from __future__ import annotations

from typing import Callable

import torch

from refmla import reference as ref
from refmla.attended import Attended
from refmla.synthetic.faults import Planting, fault

Visibility = Callable[[int, int, int], torch.Tensor]  # (b, L, n) -> [n, L] bool


def _verify_parts(p: Planting) -> list[tuple[int, int, int]]:
    """(b, L, n) for each request of a verify capture; ValueError for another mode."""
    t = p.t
    if t.get("qo_indptr") is None or not p.spec.draft_token_num:
        raise ValueError("a verify fault needs a verify preset (kimi-k2-tp8-mtp, kimi-k2-tp8-eagle-tree)")
    qo, ip = t["qo_indptr"].long(), t["kv_indptr"].long()
    return [(b, int(ip[b + 1] - ip[b]), int(qo[b + 1] - qo[b])) for b in range(len(qo) - 1)]


def _own(p: Planting, b: int, L: int, n: int) -> torch.Tensor:
    """[n, L] what request b's queries see in the capture (its tree mask, or causal)."""
    return p.att.visibility(b)


def run_visible(p: Planting, visible: Visibility, **kw) -> torch.Tensor:
    """The reference with each request's visibility replaced by ``visible(b, L, n)`` [n, L]."""
    parts = _verify_parts(p)
    masks = [visible(b, L, n).reshape(-1) for b, L, n in parts]
    indptr = torch.zeros(len(parts) + 1, dtype=torch.int64)
    indptr[1:] = torch.cumsum(torch.tensor([n * L for _, L, n in parts], dtype=torch.int64), 0)
    t = p.t
    att = Attended.from_tensors({**t, "custom_mask": torch.cat(masks), "mask_indptr": indptr})
    return ref.mla_verify_ref(kw.pop("q", t["q"]), kw.pop("kvb", t["kv_buffer"]), att, p.scales)[0]


@fault("causal_top_left", "causal mask aligned top-left: query i of n sees positions 0..i, not 0..L-n+i",
       expect="causal_alignment", mode="verify", preset="kimi-k2-tp8-mtp")
def _causal_top_left(p: Planting):
    def top_left(b: int, L: int, n: int) -> torch.Tensor:
        return torch.arange(L)[None, :] <= torch.arange(n)[:, None]  # [n, L]

    return run_visible(p, top_left), {"alignment": "top-left"}


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@fault("qlen_pow2_padding", "qlen padded to the next power of two: request b's query i read from row b*Q + i",
       mode="verify", preset="kimi-k2-tp8-mtp")
def _qlen_pow2_padding(p: Planting):
    parts = _verify_parts(p)
    n = max(k for _, _, k in parts)
    Q = next_pow2(n)
    if Q == n:
        raise ValueError(f"qlen {n} is a power of two: nothing to pad (use kimi-k2-tp8-mtp, qlen 3)")
    q = padded_queries(p.t["q"], p.t["qo_indptr"], Q)
    return run_visible(p, lambda b, L, k: _own(p, b, L, k), q=q), {"qlen": n, "padded_to": Q, "reads": "queries"}


def padded_queries(q: torch.Tensor, qo_indptr: torch.Tensor, Q: int) -> torch.Tensor:
    """q as a kernel with a query stride of Q per request reads it: row qo[b] + i <- q[b * Q + i]
    (zeros past the end)."""
    out = torch.zeros_like(q)
    qo = qo_indptr.long()
    for b in range(len(qo) - 1):
        for i in range(int(qo[b + 1] - qo[b])):
            src = b * Q + i
            if src < q.shape[0]:
                out[int(qo[b]) + i] = q[src]
    return out


@fault("mask_wrong_request", "each request's drafts see each other through the next request's tree mask",
       mode="verify", preset="kimi-k2-tp8-eagle-tree")
def _mask_wrong_request(p: Planting):
    parts = _verify_parts(p)
    if p.t.get("custom_mask") is None or len(parts) < 2:
        raise ValueError("mask_wrong_request needs a tree preset with 2+ requests (kimi-k2-tp8-eagle-tree)")

    def other(b: int, L: int, n: int) -> torch.Tensor:
        b2, L2, n2 = parts[(b + 1) % len(parts)]
        vis = _own(p, b, L, n).clone()
        vis[:, L - n :] = _own(p, b2, L2, n2)[:, L2 - n2 :]  # the other request's draft block
        return vis

    return run_visible(p, other), {"request": 0, "mask_of": 1 % len(parts)}


@fault("draft_kv_missing", "the drafts' KV rows were not in the pool when the kernel ran (read as zeros)",
       mode="verify", preset="kimi-k2-tp8-mtp")
def _draft_kv_missing(p: Planting):
    parts = _verify_parts(p)
    kvz = p.t["kv_buffer"].clone()
    for b, L, n in parts:
        lo, _ = p.bounds(b)
        kvz[p.t["kv_indices"][lo + L - n : lo + L].long()] = 0
    return p.run(kvb=kvz), {"how": "zeroed", "drafts": max(n for _, _, n in parts)}


__all__ = ["next_pow2", "padded_queries", "run_visible"]
