"""Which simple mistake explains a chunked-prefill piece (the new tokens' attention, or chunk i's)
that differs from fp64 attention over its documented keys: each variant is the same attention
(refmla.merge.mha) over the keys or mask the mistaken kernel used, for one failing request's
rows, judged by the one comparator (its own control the noise floor). Tried in this order:

    piece_lse_base        the output agrees, the lse is in the other base (a log2 lse handed to a
                          natural-log merge, or back)
    chunk_keys_missing    chunk i's attention over its keys less the last (or first) n of the
                          request's chunk (a block or page of the chunk not read)
    chunk_other_keys      over another request's keys of the same chunk, or another chunk's keys
                          (the chunk's key offsets, cu_seqlens_k, misread)
    piece_mask            a chunk attended with a causal mask (bottom-right or top-left), or the
                          new tokens' piece attended without its causal mask
"""

from __future__ import annotations

from typing import Callable, Iterator, Optional

import torch

from refmla.compare import Tolerance, compare, judge_lse
from refmla.merge.chunked_format import ChunkedCapture
from refmla.merge.mha import in_base, piece
from refmla.results import Explanation

MAX_CANDIDATES = 64  # other-keys variants tried per request
# a variant: (hypothesis, detail, keys(b) -> (k, v) or None, causal mask ("" the piece's own))
Variant = tuple[str, dict, Optional[Callable], Optional[str]]


def label(which: int) -> str:
    return "new_tokens" if which < 0 else f"chunk_{which}"


def _missing(cap: ChunkedCapture, which: int, b: int) -> Iterator[Variant]:
    if which < 0:
        return
    sl = cap.keys(which, b)
    L = sl.stop - sl.start
    sizes = sorted({2**p for p in range(max(1, L).bit_length())} | {16, 32, 64, 128, 256})
    for end in ("last", "first"):
        for n in (n for n in sizes if 0 < n < L):
            rows = slice(sl.start, sl.stop - n) if end == "last" else slice(sl.start + n, sl.stop)
            yield ("chunk_keys_missing", {"chunk": which, "request": b, "missing": n, "end": end, "keys": L},
                   lambda _b, r=rows: (cap.chunk_k[r], cap.chunk_v[r]), "")  # fmt: skip


def _other(cap: ChunkedCapture, which: int, b: int) -> Iterator[Variant]:
    if which < 0:
        return
    pairs = [(which, c) for c in range(cap.requests) if c != b] + \
            [(j, c) for j in range(cap.chunks) for c in range(cap.requests) if j != which]  # fmt: skip
    pairs = [(j, c) for j, c in pairs if int(cap.chunk_lens[j, c]) > 0][:MAX_CANDIDATES]
    for j, c in pairs:
        sl = cap.keys(j, c)
        yield ("chunk_other_keys", {"chunk": which, "request": b, "read_chunk": j, "read_request": c},
               lambda _b, s=sl: (cap.chunk_k[s], cap.chunk_v[s]), "")  # fmt: skip


def _mask(cap: ChunkedCapture, which: int, b: int) -> Iterator[Variant]:
    for mask in (("bottom_right", "top_left") if which >= 0 else (None,)):
        yield "piece_mask", {"piece": label(which), "request": b, "mask": mask or "none"}, None, mask


FAMILIES = (_missing, _other, _mask)


def _rows_fit(cap, which, got, b, keys, causal, tol) -> Optional[tuple[float, float]]:
    """(max abs err, worst ratio) when request b's rows of ``got`` match the variant within noise."""
    r = slice(cap.qo[b], cap.qo[b + 1])
    want, _ = piece(cap, which, keys=keys, causal=causal, requests=[b])
    ctl, _ = piece(cap, which, got.dtype, keys=keys, causal=causal, requests=[b])
    c = compare("variant", got[r], want[r], ctl[r], tol=tol)
    return (c.max_abs_err, float(c.worst.ratio or 0.0)) if c.passed else None


def _lse_base(cap: ChunkedCapture, which: int, lse: torch.Tensor, b: int, tol: Tolerance) -> Optional[dict]:
    """The other-base reading of request b's lse rows, when it fits."""
    r = slice(cap.qo[b], cap.qo[b + 1])
    want = piece(cap, which, requests=[b])[1]
    ctl = piece(cap, which, torch.float32, requests=[b])[1]
    doc = cap.meta.lse_base
    other = "e" if doc == "2" else "2"
    ok = ~judge_lse(lse[r], in_base(want[r], other), in_base(ctl[r], other), k=tol.k).bad
    if bool(ok.all()) and bool(torch.isfinite(want[r]).any()):
        return {"piece": label(which), "request": b, "documented_base": doc, "returned_in": other}
    return None


def explain_piece(cap: ChunkedCapture, which: int, got: torch.Tensor, lse: torch.Tensor, out_failed: list[int],
                  lse_failed: list[int], tol: Tolerance, heads: dict) -> Optional[Explanation]:  # fmt: skip
    """The first variant that explains the failing requests' rows of piece ``which``, per request:
    the worst (first) request's is the explanation, the others listed as explained or not."""
    found: dict[int, tuple[str, dict, float, float]] = {}
    for b in sorted(set(out_failed) | set(lse_failed)):
        if b not in out_failed:
            d = _lse_base(cap, which, lse, b, tol)
            if d is not None:
                found[b] = ("piece_lse_base", d, 0.0, 0.0)
            continue
        for family in FAMILIES:
            hit = next(((name, detail, *fit) for name, detail, keys, causal in family(cap, which, b)
                        if (fit := _rows_fit(cap, which, got, b, keys, causal, tol)) is not None), None)  # fmt: skip
            if hit is not None:
                found[b] = hit  # type: ignore[assignment]
                break
    failing = sorted(set(out_failed) | set(lse_failed))
    if not found:
        return None
    b = min(found)
    name, detail, err, ratio = found[b]
    r = [cap.qo[b], cap.qo[b + 1] - 1]
    others = [{"request": c, "hypothesis": found[c][0], "detail": found[c][1]} for c in sorted(found) if c != b]
    return Explanation(hypothesis=name, request=b, detail={**detail, "rows": r}, max_abs_err=err, residual_ratio=ratio,
                       heads=heads.get(b, []), extra={"per_request": others} if others else {},
                       explained_requests=sorted(found), unexplained_requests=[c for c in failing if c not in found])  # fmt: skip


__all__ = ["FAMILIES", "MAX_CANDIDATES", "explain_piece", "label"]
