"""A synthetic disaggregated pair over sparse pools: DeepSeek-V4 (a window cache and a compressed
C4 / C128 cache per layer) or V3.2 (one latent cache), prefill node and decode node.

SGLang 0.5.23's V4 pool (``DeepSeekV4TokenToKVPool``) moves two caches per layer: the compressed
cache (registered by ``get_contiguous_buf_infos``; a request's pages are its full page ids,
``req_to_token[:seq_len] // page_size``: compressed entry i of a request sits at
``page_table[i // (page_size / ratio)]``) and the window cache (a ``StateType.SWA`` state:
``full_to_swa[req_to_token[window_start:seq_len]]``, window_start = max(prefix, seq_len - window)
rounded down to its page). So, per (layer, rank): each request's tokens and compressed entries are
packed once (refmla.sparse.layouts); each side hands out its own shuffled pages; the prefill side
holds the window's pages (earlier ones freed: garbage) and every compressed entry; the transfer
copies those pages, the decode side then writes its decode tokens. Each capture records the KV map
(refmla.sparse.format: seq_lens, each cache's token per position, -1 outside the window, the page
maps) and a correct kernel's ``out`` over what its pool holds (refmla.sparse.faults, no fault).

Faults (planted here, on the decode side's bytes, before its pages are packed), and what
``refmla disagg`` must name (``expect``):

    none                      a clean pair
    compressed_page_missing   one page of the fault request's compressed cache never landed (zero bytes)
    window_page_shifted       one window-cache page (one transfer run) written one position off
    window_rope_byte          one bf16 rope byte of one window token differs (nothing else)
    compressed_scale_byte     one UE8M0 scale byte of one compressed entry differs (nothing else)

Files: ``OUT/prefill/L{layer}-R{rank}-c0.safetensors``, ``OUT/decode/L{layer}-R{rank}-s{step}.safetensors``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from refmla.sparse.faults import planted_output
from refmla.sparse.layouts import LAYOUTS, PackedLayout, dequantize, quantize, rows_to_pages, sections, token_rows
from refmla.sparse.presets import SparsePreset, for_layer, sparse_preset
from refmla.sparse.synth import Pool, SparseCase
from refmla.sparse.validation import write_sparse
from refmla.synthetic.disagg_faults import lookup

GARBAGE = 0xFF  # a freed / never written token: NaN in e4m3fn, UE8M0 (255), fp32 and bf16


@dataclass
class SparseDisaggSpec:
    name: str = "disagg-v4"
    preset: str = "deepseek-v4-flash-tp8"  # the shapes (refmla.sparse.presets)
    layers: tuple = (2, 3)  # layers of the model (V4-Flash: 2 is C4, 3 is C128); () for V3.2: one unnamed layer
    ranks: tuple = (0,)
    prompts: tuple = (600, 130, 1100, 45)  # prompt tokens per request
    decode_steps: int = 2
    fault_request: int = 2
    fault_layer: Optional[int] = 2
    fault_rank: int = 0
    seed: int = 0
    transfer_backend: str = "mori"

    def layer_preset(self, layer: Optional[int]) -> SparsePreset:
        p = sparse_preset(self.preset)
        return for_layer(p, layer) if layer is not None else p


SPARSE_DISAGG_PRESETS: dict[str, SparseDisaggSpec] = {
    "disagg-v4": SparseDisaggSpec(),
    "disagg-v32": SparseDisaggSpec(name="disagg-v32", preset="deepseek-v3.2-tp8", layers=(None,), fault_layer=None,
                                   prompts=(300, 97, 520, 45)),
}  # fmt: skip


@dataclass
class Side:
    """One node's cache of one layer: its token rows and each request's pages in position order."""

    rows: torch.Tensor  # [pages * page_size, bytes_per_token] uint8
    pages: list[torch.Tensor]  # per request: the page of each of its pages


@dataclass
class CacheWorld:
    name: str  # "window" | "main" | "compressed"
    layout: PackedLayout
    page: int
    truth: list[torch.Tensor]  # per request: [n, bytes_per_token] every position's packed token
    prefill: Side
    decode: Side
    window: Optional[int] = None  # the window cache's window (else every position is held)
    ratio: int = 1  # positions per entry (the compressed cache: compress_ratio tokens)

    def held_from(self, seq_len: int) -> int:
        """The first position this cache holds at ``seq_len`` tokens (the window's first page)."""
        return 0 if self.window is None else max(0, seq_len - self.window) // self.page * self.page

    def tokens(self, side: Side, b: int, seq_len: int) -> torch.Tensor:
        """Request b's token per position at ``seq_len`` (-1 before the window), int32."""
        n = seq_len // self.ratio
        j = torch.arange(n)
        tok = side.pages[b][j // self.page] * self.page + j % self.page
        return torch.where(j >= self.held_from(seq_len), tok, -1).to(torch.int32)


@dataclass
class World:
    spec: SparseDisaggSpec
    preset: SparsePreset
    layer: Optional[int]
    rank: int
    caches: list[CacheWorld]
    g: torch.Generator

    def rid(self, b: int) -> str:
        return f"{self.spec.name}-r{b}"


def _truth(n: int, layout: PackedLayout, g: torch.Generator) -> torch.Tensor:
    """n random tokens packed ([n, bytes_per_token]), tiles of different amax."""
    k = torch.randn(max(n, 1), layout.head_dim, generator=g, dtype=torch.float64)
    k[:, : layout.d_nope] *= torch.linspace(0.5, 2.0, layout.d_nope, dtype=torch.float64)
    return token_rows(quantize(k, layout, 1), layout, 1)[:n]


def _side(counts: list[int], page: int, bpt: int, g: torch.Generator) -> Side:
    """Shuffled pages for counts[b] positions per request (page 0 and two spare pages unused)."""
    need = [max(1, -(-n // page)) for n in counts]
    perm = torch.randperm(sum(need) + 2, generator=g) + 1
    pages, used = [], 0
    for k in need:
        pages.append(perm[used : used + k])
        used += k
    return Side(torch.full(((sum(need) + 3) * page, bpt), GARBAGE, dtype=torch.uint8), pages)


def _cache(name: str, layout: PackedLayout, page: int, counts: list[int], window: Optional[int], ratio: int,
           g: torch.Generator) -> CacheWorld:  # fmt: skip
    truth = [_truth(n, layout, g) for n in counts]
    return CacheWorld(name, layout, page, truth, _side(counts, page, layout.bytes_per_token, g),
                      _side(counts, page, layout.bytes_per_token, g), window, ratio)  # fmt: skip


def make_world(spec: SparseDisaggSpec, layer: Optional[int], rank: int) -> World:
    """One (layer, rank): every position's packed bytes, both sides' pages; the prefill side filled."""
    p = spec.layer_preset(layer)
    g = torch.Generator().manual_seed(spec.seed * 7919 + (layer or 0) * 131 + rank)
    total = [L + spec.decode_steps for L in spec.prompts]
    L = LAYOUTS[p.kv_layout]
    caches = [_cache("window" if p.window is not None else "main", L, p.page_size, total, p.window, 1, g)]
    if p.has_extra:
        caches.append(_cache("compressed", L, p.extra_page_size, [n // p.compress_ratio for n in total], None,
                             p.compress_ratio, g))  # fmt: skip
    w = World(spec, p, layer, rank, caches, g)
    for c in caches:
        for b, Lp in enumerate(spec.prompts):  # what the prefill node holds: the window's pages, every entry
            _write(c, c.prefill, b, c.held_from(Lp) // c.ratio, Lp // c.ratio)
    return w


def _write(c: CacheWorld, side: Side, b: int, lo: int, hi: int, rows: Optional[torch.Tensor] = None) -> None:
    """Positions [lo, hi) of request b written into ``side`` (the truth, or ``rows``)."""
    j = torch.arange(lo, hi)
    side.rows[side.pages[b][j // c.page] * c.page + j % c.page] = c.truth[b][lo:hi] if rows is None else rows


def transfer(w: World) -> None:
    """What the transfer and the decode node write: the held positions' pages, then the decode tokens."""
    for c in w.caches:
        for b, Lp in enumerate(w.spec.prompts):
            _write(c, c.decode, b, c.held_from(Lp) // c.ratio, (Lp + w.spec.decode_steps) // c.ratio)


# --------------------------------------------------------------------------------------------
# Faults: the decode side's bytes, changed after the transfer
# --------------------------------------------------------------------------------------------


@dataclass
class SparseDisaggFault:
    name: str
    description: str
    fault_class: str  # what disagg must name: transfer | none
    cache: Optional[str] = None  # the cache it hits: "window" | "compressed"
    plant: Callable[[World, dict], None] = lambda w, where: None

    def applies(self, spec: SparseDisaggSpec) -> bool:
        return self.cache != "compressed" or spec.layer_preset(spec.fault_layer).has_extra


def _cache_of(w: World, name: str) -> CacheWorld:
    return next(c for c in w.caches if c.name == name or (name == "window" and c.name == "main"))


def _page_missing(w: World, where: dict) -> None:
    c, b = _cache_of(w, "compressed"), w.spec.fault_request
    _write(c, c.decode, b, c.page, 2 * c.page, torch.zeros(c.page, c.layout.bytes_per_token, dtype=torch.uint8))
    where.update(cache=c.name, position=c.page, page=1, zero_rows=True)


def _page_shifted(w: World, where: dict) -> None:
    c, b = _cache_of(w, "window"), w.spec.fault_request
    first = c.held_from(w.spec.prompts[b]) // c.page
    lo, hi = first * c.page, (first + 1) * c.page
    assert hi < w.spec.prompts[b], "the fault request's window must hold a whole page and one more position"
    _write(c, c.decode, b, lo, hi, c.truth[b][lo + 1 : hi + 1])  # decode row j holds prefill row j + 1
    where.update(cache=c.name, position=lo, page=first, offset=1)


def _one_byte(name: str, section: str) -> Callable[[World, dict], None]:
    def plant(w: World, where: dict) -> None:
        c, b = _cache_of(w, name), w.spec.fault_request
        j = c.held_from(w.spec.prompts[b]) // c.ratio + 5
        row = c.truth[b][j : j + 1].clone()
        row[0, sections(c.layout)[section][0]] += 1  # the section's first byte: a rope bit / the exponent + 1
        _write(c, c.decode, b, j, j + 1, row)
        where.update(cache=c.name, position=j, page=j // c.page, sections=section)

    return plant


SPARSE_DISAGG_FAULTS: dict[str, SparseDisaggFault] = {f.name: f for f in (
    SparseDisaggFault("none", "a clean pair", "none"),
    SparseDisaggFault("compressed_page_missing",
                      "page 1 of the fault request's compressed cache never landed (zero bytes)",
                      "transfer", "compressed", _page_missing),
    SparseDisaggFault("window_page_shifted",
                      "the fault request's first window-cache page (V3.2: main cache) written one position off",
                      "transfer", "window", _page_shifted),
    SparseDisaggFault("window_rope_byte", "one bf16 rope byte of one window-cache (V3.2: main cache) token differs",
                      "transfer", "window", _one_byte("window", "rope")),
    SparseDisaggFault("compressed_scale_byte",
                      "one UE8M0 scale byte of one compressed entry differs (its exponent + 1)",
                      "transfer", "compressed", _one_byte("compressed", "scales")),
)}  # fmt: skip


# --------------------------------------------------------------------------------------------
# The captures
# --------------------------------------------------------------------------------------------


def _pool(c: CacheWorld, side: Side) -> Pool:
    pages = rows_to_pages(side.rows, c.layout, c.page)
    return Pool(pages, dequantize(pages, c.layout, c.page), c.page, c.layout.name)


def _lists(tokens: list[torch.Tensor], width: int, window: Optional[int], g: torch.Generator,
           clamp1: bool = False) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Each request's index list at its last position ([B, 1, width] int32, lengths [B]): the window in
    position order, else a random top-k of what the cache holds; -1 after (C4 / C128: length >= 1)."""
    rows, lens = [], []
    for tok in tokens:
        held = tok[tok >= 0]
        chosen = held[-window:] if window is not None else held[torch.randperm(held.numel(), generator=g)[:width]]
        row = torch.full((width,), -1, dtype=torch.int32)
        row[: chosen.numel()] = chosen
        rows.append(row)
        lens.append(max(chosen.numel(), 1) if clamp1 else chosen.numel())
    return torch.stack(rows)[:, None], torch.tensor(lens, dtype=torch.int32)


def _case(w: World, sides: list[Side], pools: list[Pool], lens: list[int]) -> SparseCase:
    """One call: each request's query at its last position over what ``sides`` hold."""
    p, c0 = w.preset, w.caches[0]
    q = torch.randn(len(lens), 1, p.heads, LAYOUTS[p.kv_layout].head_dim, generator=w.g).to(torch.bfloat16)
    idx, n = _lists([c0.tokens(sides[0], b, L) for b, L in enumerate(lens)], p.topk, p.window, w.g)
    sink = (torch.randn(p.heads, generator=w.g) * 2).float() if p.sink else None
    case = SparseCase(p, q, pools[0], idx, n, sink)
    if len(w.caches) > 1:
        c1 = w.caches[1]
        case.extra = pools[1]
        case.extra_indices, case.extra_topk_length = _lists([c1.tokens(sides[1], b, L) for b, L in enumerate(lens)],
                                                            p.extra_topk, None, w.g, clamp1=True)  # fmt: skip
    return case


def kv_map(w: World, sides: list[Side], lens: list[int], pools: list[Pool]) -> dict[str, torch.Tensor]:
    """The capture's KV map (refmla.sparse.format): lengths, each cache's token per position, its pages."""
    t = {"seq_lens": torch.tensor(lens, dtype=torch.int32)}
    for prefix, c, side, pool in zip(("", "extra_"), w.caches, sides, pools):
        per = [c.tokens(side, b, L) for b, L in enumerate(lens)]
        ptr = torch.zeros(len(per) + 1, dtype=torch.int32)
        ptr[1:] = torch.cumsum(torch.tensor([x.numel() for x in per]), 0)
        t.update({f"{prefix}slot_indptr": ptr, f"{prefix}slots": torch.cat(per),
                  f"{prefix}k_cache_pages": torch.arange(pool.pages.shape[0], dtype=torch.int32)})  # fmt: skip
    return t


def write_side(w: World, out: Path, side: str, fault: str) -> list[Path]:
    """The prefill node's capture (each request's last prompt row), or one decode capture per step."""
    sides = [c.prefill if side == "prefill" else c.decode for c in w.caches]
    pools = [_pool(c, s) for c, s in zip(w.caches, sides)]
    prompts = list(w.spec.prompts)
    steps = [(0, prompts)] if side == "prefill" else [(s, [L + 1 + s for L in prompts]) for s in range(w.spec.decode_steps)]
    paths = []
    for step, lens in steps:
        case = _case(w, sides, pools, lens)
        o, lse = planted_output(case, None)  # a correct kernel over what this node's pool holds
        meta = {**case.meta(), "layer_id": w.layer or 0, "tp_rank": w.rank, "step": step,
                "rids": [w.rid(b) for b in range(len(lens))], "disagg_mode": side,
                "disagg_transfer_backend": w.spec.transfer_backend,
                "synth": {"preset": w.spec.name, "seed": w.spec.seed, "fault": fault, "side": side}}  # fmt: skip
        name = f"L{w.layer or 0}-R{w.rank}-{'c' if side == 'prefill' else 's'}{step}.safetensors"
        path = out / side / name
        write_sparse(path, {**case.tensors(), "out": o, "lse": lse, **kv_map(w, sides, lens, pools)}, meta)
        paths.append(path)
    return paths


def synth_sparse_disagg(out: Any, spec: SparseDisaggSpec, fault: str = "none") -> dict:
    """Write the pair under ``out`` (prefill/ and decode/); returns what was planted and what
    ``refmla disagg`` must name for it (``expect``)."""
    f = lookup(SPARSE_DISAGG_FAULTS, fault, "sparse disagg fault")
    if not f.applies(spec):
        raise ValueError(f"fault {fault!r} hits the compressed cache; preset {spec.name} has none")
    out = Path(out)
    where: dict = {}
    for layer in spec.layers:
        for rank in spec.ranks:
            w = make_world(spec, layer, rank)
            transfer(w)
            if (layer, rank) == (spec.fault_layer, spec.fault_rank):
                f.plant(w, where)
            write_side(w, out, "prefill", fault)
            write_side(w, out, "decode", fault)
    expect = {"class": f.fault_class, "all_rows": False, "layer": spec.fault_layer or 0, "rank": spec.fault_rank,
              "rid": f"{spec.name}-r{spec.fault_request}", "cache": f.cache, **where}  # fmt: skip
    return {"fault": fault, "preset": spec.name, "expect": expect}


def sparse_disagg_preset(name: str, **overrides: Any) -> SparseDisaggSpec:
    if name not in SPARSE_DISAGG_PRESETS:
        raise KeyError(f"unknown sparse disagg preset {name!r}; choose from {', '.join(SPARSE_DISAGG_PRESETS)}")
    return dataclasses.replace(SPARSE_DISAGG_PRESETS[name], **overrides)


def describe() -> str:
    return "\n".join(f"{n:<24} {f.description}" for n, f in SPARSE_DISAGG_FAULTS.items())


__all__ = ["SPARSE_DISAGG_FAULTS", "SPARSE_DISAGG_PRESETS", "SparseDisaggSpec", "describe", "kv_map", "make_world",
           "sparse_disagg_preset", "synth_sparse_disagg", "transfer"]
