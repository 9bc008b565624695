"""Which simple sparse-decode mistake explains a diverging output (docs/contract.md section 4,
"sparse hypotheses"). Each candidate recomputes the fp64 reference with one mistake made on purpose
and is judged with the same comparator and tolerance; the simplest that fits is the explanation,
the others that fit are alternatives.

    sink_omitted / sink_twice                     the sink's term 0 or 2 times in the denominator
    topk_length_ignored(scope)                    entries past topk_length read (-1 still skipped): both, main, extra
    minus_one_as_slot0                            every -1 (lengths folded into -1) read as token 0
    page_offset_dropped(scope)                    each index read as page * page_size (offset lost)
    extra_cache_ignored                           the compressed cache's entries not read
    window_off_by_one(delta=-1, side)             a full window one entry short (start or end)
    scale_exponent_off(tile, factor, cache)       one tile's scale times 2 or 1/2 (UE8M0 exponent +-1): main, extra, both
    wrong_sm_scale(ratio)                         the softmax scale times a named ratio (1/sqrt(576) for the given, ...)
    output_rows_permuted / other_rows_read        rows written to another request's row, an entry read at slot +- 1
                                                  (refmla.sparse.misplaced), when no whole-call mistake fits
    rope_wrong_bytes(offset)                      the rope section read 2 bytes early or late
    kv_fp8_encoding_mismatch(written, read)       the caches' fp8 bytes read in another encoding (e4m3fn <->
                                                  e4m3fnuz: DeepSeek-V4 on MI300X; an e5m2 cache
                                                  read as e4m3), both caches
    kv_scale_format(stored, read, how, cache)     V3.2's fp32 tile scales read as bf16 or UE8M0
                                                  (refmla.sparse.readings.SCALE_READINGS)
    kv_page_stride(stride, page_stride)           the main cache's pages read at another stride (padded <-> unpadded)
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Optional

import torch

from refmla.compare import Tolerance, compare
from refmla.options import SEARCH_REQUEST_BYTES
from refmla.results import Alternative, Explanation
from refmla.sparse.format import SparseCapture
from refmla.sparse.layouts import dequantize
from refmla.sparse.misplaced import neighbour_slot, rows_permuted
from refmla.sparse.readings import as_fp8, scale_readings, scales_read_as, strided
from refmla.sparse.reference import SparseOutput, attend_rows, call_table, judge_out, rows_of
from refmla.sparse.rows import SparseRows, raw_rows, sparse_rows


@dataclass(frozen=True)
class Mistake:
    name: str
    detail: dict
    rows: Optional[Callable[[SparseCapture], SparseRows]] = None  # what is read
    decode: Optional[Callable] = None  # how the main cache's tokens are decoded (from the bytes)
    tile: Optional[tuple[int, float, tuple]] = None  # (tile, factor, pools) applied to those caches' keys
    sink_terms: int = 1
    scale: float = 1.0  # the softmax scale used, as a ratio of the capture's
    why: Optional[str] = None  # what the mistake is, in words (wrong_sm_scale)
    all_caches: bool = False  # ``decode`` applies to the extra cache too (an encoding is the pool's, not one cache's)


SCREEN_ROWS = 4  # failing query rows a candidate is first computed on
MAX_CACHED_TOKENS = 1 << 17  # pools up to this many tokens are decoded once per search
SEARCH_SECONDS = 30.0  # the search's wall-time budget (default; $REFMLA_SEARCH_SECONDS): past it, it stops and says what it tried


def search_seconds() -> float:
    """The search's budget in seconds: $REFMLA_SEARCH_SECONDS when set to a number >= 0, else SEARCH_SECONDS."""
    try:
        v = float(os.environ.get("REFMLA_SEARCH_SECONDS", SEARCH_SECONDS))
    except ValueError:
        return SEARCH_SECONDS
    return v if v >= 0 and math.isfinite(v) else SEARCH_SECONDS


def too_large_to_search(cap: SparseCapture, rows: SparseRows) -> Optional[str]:
    """Why the call is past the search's budget (the dense one's, SEARCH_REQUEST_BYTES a request: its
    rows' gathered keys in fp64 and their logits), or None. The search works in blocks of query rows
    (the reference's), so its memory follows a block; this bounds the work a request may ask of it."""
    B, S, H, D = cap.q.shape
    W = rows.token.shape[1]
    need = S * W * (D * 8 + H * 8)
    if need <= SEARCH_REQUEST_BYTES:
        return None
    return (f"each request's {S} query row(s) attend up to {W:,} entries: searching one would hold "
            f"{need / 2**30:.1f} GiB (budget {SEARCH_REQUEST_BYTES / 2**30:.0f} GiB); not searched")  # fmt: skip


class Decoded:
    """Each cache decoded once for the whole search (small pools), else token by token; the rows
    every candidate reads unless it says otherwise, and their keys (the call's one table,
    refmla.sparse.reference.call_table: the reference's)."""

    def __init__(self, cap: SparseCapture):
        self.cap, self.full = cap, {}
        for cache, layout, page in ((cap.k_cache, cap.meta.layout, cap.meta.page_size),
                                    (cap.extra_k_cache, cap.meta.extra_layout, cap.meta.extra_page_size)):  # fmt: skip
            if cache is not None and cache.shape[0] * page <= MAX_CACHED_TOKENS:
                self.full[id(cache)] = dequantize(cache, layout, page, cap.meta.kv_fp8_dtype)
        self.base_rows = rows_of(cap)
        self.base_keys = call_table(cap, self.base_rows)  # Keys of every row, or None (too large: by blocks)

    def __call__(self, cache, layout, page, fp8, tokens):
        full = self.full.get(id(cache))
        return full[tokens] if full is not None else dequantize(cache, layout, page, fp8, tokens)


def _attend(cap: SparseCapture, mk: Mistake, decoded: Decoded, only: Optional[torch.Tensor] = None) -> SparseOutput:
    """The fp64 output with ``mk`` made (the reference's blocked work, refmla.sparse.reference.attend_rows):
    of every row, or of the query rows ``only`` [n] (out [n, H, Dv], lse [n, H])."""
    base = decoded.base_rows
    rows = mk.rows(cap) if mk.rows else base
    main_decode = mk.decode or decoded

    def decode(cache, layout, page, fp8, tokens):
        return (main_decode if cache is cap.k_cache or mk.all_caches else decoded)(cache, layout, page, fp8, tokens)

    same = (mk.decode is None and rows.token.shape == base.token.shape and torch.equal(rows.token, base.token)
            and torch.equal(rows.pool_id, base.pool_id) and not bool((rows.valid & ~base.valid).any()))  # fmt: skip
    B, S, H, D = cap.q.shape
    q = cap.q.reshape(B * S, H, D)
    pick = torch.arange(B * S) if only is None else only  # [n] query rows computed
    if only is not None:
        rows, q = rows.part(only), q[only]
    keys = None
    if same and decoded.base_keys is not None:  # the reference's table (its zero row stands for what is not read)
        keys = decoded.base_keys.rows(pick)
    sink = cap.attn_sink
    if sink is not None:
        sink = None if mk.sink_terms == 0 else sink.double() + math.log(mk.sink_terms)
    edit = None
    if mk.tile is not None:
        tile, factor, pools = mk.tile
        width = cap.meta.layout.tile

        def edit(table, pool):  # that tile of those caches' keys times factor
            hit = torch.isin(pool, torch.tensor(pools, dtype=torch.int8))[:, None]  # [n, 1]
            return torch.where(hit & (torch.arange(table.shape[-1]) // width == tile), table * factor, table)

    out, lse = attend_rows(cap, q, rows, sink, cap.meta.softmax_scale * mk.scale, keys,
                           None if same else decode, edit)  # fmt: skip
    if only is not None:
        return SparseOutput(out, lse)
    Dv = cap.meta.head_dim_v
    return SparseOutput(out.reshape(B, S, H, Dv), lse.reshape(B, S, H))


def _lengths_ignored(scope: str) -> Callable[[SparseCapture], SparseRows]:
    def rows(c: SparseCapture) -> SparseRows:
        main = None if scope in ("both", "main") else c.topk_length
        extra = None if scope in ("both", "extra") else c.extra_topk_length
        return sparse_rows(c.indices, main, c.extra_indices, extra)

    return rows


def _folded_slot0(cap: SparseCapture) -> SparseRows:
    return raw_rows(cap.indices, cap.topk_length, cap.extra_indices, cap.extra_topk_length)


def _window_short(side: str) -> Callable[[SparseCapture], SparseRows]:
    def rows(cap: SparseCapture) -> SparseRows:
        r = rows_of(cap)
        valid = r.valid.clone()
        main = (r.pool_id == 0) & valid  # [R, W]
        for i in (main.sum(1) == cap.meta.window).nonzero().flatten().tolist():
            cols = main[i].nonzero().flatten()  # main entries come first, in list order
            valid[i, cols[0] if side == "start" else cols[-1]] = False
        return replace(r, valid=valid)

    return rows


def _offset_dropped(cap: SparseCapture) -> SparseRows:
    r = rows_of(cap)
    page = cap.meta.page_size
    return replace(r, token=torch.where(r.pool_id == 0, r.token // page * page, r.token))


def _rope_shifted(offset: int):
    def decode(cache, layout, page, fp8, tokens):
        k = dequantize(cache, layout, page, fp8, tokens)
        flat = cache.view(torch.uint8).reshape(-1)
        P = cache.shape[0]
        p, s = tokens // page, tokens % page
        base = p * cache.shape[1] + (s * layout.data_bytes if layout.block_split else s * layout.bytes_per_token
                                     + layout.scale_bytes) + layout.d_nope + offset  # fmt: skip
        idx = (base[:, None] + torch.arange(2 * layout.d_rope)[None, :]).clamp(0, P * cache.shape[1] - 1)
        k[:, layout.d_nope :] = flat[idx].contiguous().view(torch.bfloat16).to(torch.float64)
        return k

    return decode


def scale_ratios(cap: SparseCapture) -> list[tuple[float, str]]:
    """Ratios r (the kernel used r * softmax_scale) that name a known mistake, as the dense
    wrong_sm_scale names them: 1/sqrt(d) for the usual head dims, no scale, the scale twice, log2(e)."""
    sm = cap.meta.softmax_scale
    out = [(d**-0.5 / sm, f"1/sqrt({d}) instead of the given softmax_scale") for d in (576, 512, 192, 128)]
    out += [(1 / sm, "no softmax scale at all"), (sm, "softmax_scale applied twice"),
            (LOG2E, "scaled by log2(e) twice (exp2 path)"), (1 / LOG2E, "log2(e) missing in an exp2 softmax")]
    return [(round(r, 9), why) for r, why in out if abs(r - 1) > 1e-6]


LOG2E = 1.0 / math.log(2.0)
# the encodings a sparse kernel reads a cache's fp8 in (an e5m2 cache: read as either e4m3)
E4M3 = ("float8_e4m3fn", "float8_e4m3fnuz")


def mistakes(cap: SparseCapture) -> list[Mistake]:
    """The candidates that apply to this capture, simplest first."""
    m, out = cap.meta, []
    if cap.attn_sink is not None:
        out += [Mistake("sink_omitted", {}, sink_terms=0), Mistake("sink_twice", {}, sink_terms=2)]
    if cap.extra_indices is not None:
        out.append(Mistake("extra_cache_ignored", {}, rows=lambda c: sparse_rows(c.indices, c.topk_length)))
    if cap.topk_length is not None or cap.extra_topk_length is not None:
        out += [Mistake("topk_length_ignored", {"scope": scope}, rows=_lengths_ignored(scope))
                for scope in ("both", "main", "extra") if scope == "main" or cap.extra_indices is not None]
    if m.window:
        out += [Mistake("window_off_by_one", {"delta": -1, "side": side}, rows=_window_short(side)) for side in ("start", "end")]
    out.append(Mistake("minus_one_as_slot0", {}, rows=_folded_slot0))
    out.append(Mistake("page_offset_dropped", {"scope": "main"}, rows=_offset_dropped))
    caches = [("main", (0,))] + ([("extra", (1,)), ("both", (0, 1))] if cap.extra_indices is not None else [])
    for tile in range(m.layout.num_tiles):
        for factor in (2.0, 0.5):
            out += [Mistake("scale_exponent_off", {"tile": tile, "factor": factor, "cache": name}, tile=(tile, factor, pools))
                    for name, pools in caches]  # fmt: skip
    out += [Mistake("wrong_sm_scale", {"ratio": r}, scale=r, why=why) for r, why in scale_ratios(cap)]
    out += [Mistake("rope_wrong_bytes", {"offset": o}, decode=_rope_shifted(o)) for o in (-2, 2)]
    out += [Mistake("kv_fp8_encoding_mismatch", {"written": m.kv_fp8_dtype, "read": other}, decode=as_fp8(other),
                    all_caches=True) for other in E4M3 if other != m.kv_fp8_dtype]  # fmt: skip
    out += [Mistake("kv_scale_format", {"stored": "fp32", "read": read, "how": how, "cache": "main"},
                    decode=scales_read_as(how)) for read, how in scale_readings(cap.k_cache, m.layout, m.page_size)]  # fmt: skip
    out += [Mistake("kv_page_stride", {"stride": w, "page_stride": int(cap.k_cache.shape[1]), "cache": "main"},
                    decode=strided(w)) for w in page_strides(cap)]  # fmt: skip
    return out


def page_strides(cap: SparseCapture) -> list[int]:
    """Page strides a kernel may assume instead of the cache's own: the page's bytes unpadded, or
    padded to a multiple of 576 (V4's rule), where that is not the stride the cache has."""
    lay, page, W = cap.meta.layout, cap.meta.page_size, int(cap.k_cache.shape[1])
    tight = page * lay.bytes_per_token
    return [w for w in dict.fromkeys((tight, -(-tight // 576) * 576)) if w != W]


def explain(cap: SparseCapture, out: torch.Tensor, ref: SparseOutput, ctrl: SparseOutput,
            tol: Tolerance, notes: Optional[dict] = None, seconds: Optional[float] = None) -> Optional[Explanation]:  # fmt: skip
    """The simplest mistake whose output ``out`` matches within the tolerance (the dense
    :class:`~refmla.results.Explanation`), with the others that do as its alternatives. Each candidate
    keeps the capture's own noise floor: its control is the candidate plus the control's error
    against the reference, row by row. A candidate is first computed on a few failing query rows
    (SCREEN_ROWS, spread over the call: a mistake that does not reproduce them is out, at the cost of
    those rows), and only a survivor on the whole call. A call past the search's budget is not searched, and a search past
    its ``seconds`` (search_seconds()) stops: None, and ``notes["search_skipped"]`` says why and what
    was tried (the dense search's ``info.search_skipped``); the replay's localization stands."""
    too_large = too_large_to_search(cap, rows_of(cap))
    if too_large is not None:
        if notes is not None:
            notes["search_skipped"] = too_large
        return None
    deadline = time.monotonic() + (search_seconds() if seconds is None else seconds)
    B, S, H, Dv = ref.out.shape
    flat = lambda t: t.reshape(B * S, H, Dv)  # noqa: E731
    noise = torch.nan_to_num(flat(ctrl.out) - flat(ref.out))  # [R, H, Dv]
    first = judge_out("observed", cap, out, ref, ctrl, tol)
    failing = torch.nonzero(first.row_failed.any(dim=1)).flatten() if first.row_failed is not None else None
    # a few failing rows spread over the call screen each candidate (its per-row verdicts are the same on
    # them alone): one that does not reproduce them is out at their cost, not the whole call's
    screen = None if failing is None or not len(failing) else failing[:: max(1, len(failing) // SCREEN_ROWS)][:SCREEN_ROWS]
    decoded = Decoded(cap)
    fits, tried, candidates = [], [], mistakes(cap)
    for mk in candidates:
        if time.monotonic() > deadline:
            if notes is not None:
                notes["search_skipped"] = _stopped(tried, candidates)
            return None
        tried.append(mk)
        try:
            if screen is not None and not _reproduces(cap, mk, decoded, out, noise, screen, tol):
                continue
            variant = _attend(cap, mk, decoded)
        except (IndexError, RuntimeError):
            continue
        noisy = SparseOutput(variant.out + noise.reshape(variant.out.shape), variant.lse)
        c = judge_out(mk.name, cap, out, variant, noisy, tol)
        if c.passed:
            fits.append((mk, c))
    if not fits and time.monotonic() > deadline:  # misplaced rows / entries not tried
        if notes is not None:
            notes["search_skipped"] = _stopped(tried, candidates + [Mistake("output_rows_permuted", {}),
                                                                    Mistake("other_rows_read", {})])  # fmt: skip
        return None
    if not fits:
        return misplaced(cap, out, ref, ctrl, tol)
    (best, c), rest = fits[0], fits[1:]
    extra = {"why": best.why, "sm_scale_used": cap.meta.softmax_scale * best.scale} if best.why else {}
    return Explanation(best.name, None, dict(best.detail), c.max_abs_err, residual_ratio=_ratio(c.worst), extra=extra,
                       alternatives=[Alternative(m.name, dict(m.detail), residual_ratio=_ratio(w.worst)) for m, w in rest])


def _reproduces(cap: SparseCapture, mk: Mistake, decoded: Decoded, out: torch.Tensor, noise: torch.Tensor,
                rows: torch.Tensor, tol: Tolerance) -> bool:  # fmt: skip
    """Whether ``mk`` brings each failing query row of ``rows`` within the tolerance: the comparator's
    per-row verdicts, which are the same on those rows alone as in the whole call."""
    H, Dv = noise.shape[1], noise.shape[2]
    variant = _attend(cap, mk, decoded, only=rows)
    got = out.reshape(-1, H, Dv)[rows]
    c = compare(mk.name, got, variant.out, variant.out + noise[rows], out_dtype=torch.bfloat16, tol=tol,
                request_of_row=cap.request_of_row()[rows])  # fmt: skip
    return c.row_failed is not None and not bool(c.row_failed.any())


def _stopped(tried: list, candidates: list) -> str:
    names = ", ".join(dict.fromkeys(m.name for m in tried)) or "none"
    left = ", ".join(dict.fromkeys(m.name for m in candidates[len(tried):]))
    return (f"the hypothesis search stopped at its budget ({search_seconds():g} s; $REFMLA_SEARCH_SECONDS): "
            f"{len(tried)} of {len(candidates)} candidates tried ({names}), none fit; not tried: {left}; "
            "the failing requests and heads are localized")  # fmt: skip


def misplaced(cap: SparseCapture, out: torch.Tensor, ref: SparseOutput, ctrl: SparseOutput,
              tol: Tolerance) -> Optional[Explanation]:  # fmt: skip
    """Output rows written to another request's row, or one entry read at the neighbouring slot
    (refmla.sparse.misplaced), when no whole-call mistake fits."""
    c = judge_out("observed", cap, out, ref, ctrl, tol)
    found = rows_permuted(cap, out, ref, ctrl, tol, c)
    if found is not None:
        return Explanation("output_rows_permuted", None, found[0], found[1].max_abs_err, residual_ratio=_ratio(found[1].worst))
    slot = neighbour_slot(cap, out, ref, ctrl, tol, c)
    if slot is not None:
        detail, request, judged = slot
        return Explanation("other_rows_read", request, detail, judged.max_abs_err, residual_ratio=_ratio(judged.worst))
    return None


def _ratio(worst) -> float:
    r = getattr(worst, "ratio", None) if worst is not None else None
    return float(r) if r is not None else 0.0


__all__ = ["SEARCH_SECONDS", "Mistake", "explain", "mistakes", "search_seconds", "too_large_to_search"]
