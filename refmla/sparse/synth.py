"""Synthetic sparse decode captures with hostile data, and production's output planted by
:mod:`refmla.sparse.faults` (its own plain loop, never the reference it is measured against).

``build_case(preset)`` builds one call: each request's context in shuffled pages of the main cache
(V4: the SWA cache, V3.2: the whole latent cache), the compressed tokens (V4 C4 / C128) in shuffled
pages of the extra cache, the index lists as SGLang builds them (V4: the window in position order;
the indexer's top-k in random order), padded to the width with stale entries of the same request
past ``topk_length`` (other requests' tokens) and then -1; C4 / C128 lengths clamped to 1 (a row with no compressed token
has one -1 entry inside its length); unused pages and the tail of every last page are NaN bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from refmla.sparse.layouts import LAYOUTS, quantize_with_values
from refmla.sparse.presets import SparsePreset

NAN_BYTE = 0x7F  # e4m3fn NaN; as a UE8M0 exponent 127 (scale 1): the fp8 NaN carries it


@dataclass
class Pool:
    pages: torch.Tensor  # [P, page stride] uint8, as stored
    values: torch.Tensor  # [P * page_size, D] fp64: what each token holds (NaN where garbage)
    page_size: int
    layout: str


@dataclass
class SparseCase:
    preset: SparsePreset
    q: torch.Tensor  # [B, 1, H, D] bf16
    main: Pool
    indices: torch.Tensor  # [B, 1, K] int32
    topk_length: torch.Tensor  # [B] int32
    sink: Optional[torch.Tensor]  # [H] fp32
    extra: Optional[Pool] = None
    extra_indices: Optional[torch.Tensor] = None  # [B, 1, K2] int32
    extra_topk_length: Optional[torch.Tensor] = None  # [B] int32

    def tensors(self) -> dict[str, torch.Tensor]:
        t = {"q": self.q, "k_cache": self.main.pages, "indices": self.indices, "topk_length": self.topk_length}
        if self.sink is not None:
            t["attn_sink"] = self.sink
        if self.extra is not None:
            t.update(extra_k_cache=self.extra.pages, extra_indices=self.extra_indices,
                     extra_topk_length=self.extra_topk_length)  # fmt: skip
        return t

    def meta(self, backend: str = "synth") -> dict:
        p = self.preset
        m = {"mode": "sparse_decode", "backend": backend, "kv_layout": p.kv_layout, "page_size": p.page_size,
             "softmax_scale": p.softmax_scale, "head_dim_v": p.head_dim_v, "compress_ratio": p.compress_ratio,
             "layer_role": p.layer_role, "model": p.model, "layer_id": p.layer_id or 0, "tp_rank": 0, "step": 0,
             "rids": [f"synth-{b}" for b in range(len(p.seq_lens))]}  # fmt: skip
        if p.window is not None:
            m["window"] = p.window
        if p.layer_id is not None and p.compress_ratios:  # a named layer of the model: its per-layer list
            m["compress_ratios"] = list(p.compress_ratios)
        if self.extra is not None:
            m.update(extra_kv_layout=self.extra.layout, extra_page_size=self.extra.page_size)
        return m


def _paged_pool(counts: list[int], layout: str, page_size: int, g: torch.Generator,
                amax_scales: bool = False) -> tuple[Pool, list]:  # fmt: skip
    """A pool holding counts[b] tokens per request in shuffled pages (two spare pages, all garbage
    where unwritten); returns it and each request's token index per position."""
    L = LAYOUTS[layout]
    per_req = [max(1, -(-n // page_size)) for n in counts]
    P = sum(per_req) + 2
    order = torch.randperm(P, generator=g)
    k = torch.randn(P * page_size, L.head_dim, generator=g, dtype=torch.float64)
    k[:, : L.d_nope] *= torch.linspace(0.5, 2.0, L.d_nope, dtype=torch.float64)  # tiles of different amax
    pages, values = quantize_with_values(k, L, page_size, amax_scales=amax_scales)
    written = torch.zeros(P * page_size, dtype=torch.bool)
    tokens, next_page = [], 0
    for n, npg in zip(counts, per_req):
        phys = order[next_page : next_page + npg]
        next_page += npg
        pos = torch.arange(n)
        tok = phys[pos // page_size] * page_size + pos % page_size
        written[tok] = True
        tokens.append(tok)
    written[0] = True  # token 0 (SGLang's padding slot) holds real-looking data: reading it must show
    _poison(pages, values, ~written, L, page_size)
    return Pool(pages, values, page_size, layout), tokens


def _poison(pages: torch.Tensor, values: torch.Tensor, garbage: torch.Tensor, L, page_size: int) -> None:
    """NaN bytes in every unwritten token (its data and its scales)."""
    for t in garbage.nonzero().flatten().tolist():
        p, s = divmod(t, page_size)
        if L.block_split:
            pages[p, s * L.data_bytes : s * L.data_bytes + L.d_nope] = NAN_BYTE
            pages[p, page_size * L.data_bytes + s * L.scale_bytes :][: L.scale_bytes] = 0xFF
        else:
            pages[p, s * L.bytes_per_token : s * L.bytes_per_token + L.d_nope] = NAN_BYTE
        values[t] = float("nan")


def _index_list(tok: torch.Tensor, chosen: torch.Tensor, width: int, others: torch.Tensor, clamp1: bool,
                g: torch.Generator) -> tuple[torch.Tensor, int]:  # fmt: skip
    """[width] int32: the chosen positions' tokens, then up to 7 stale entries (tokens of other
    requests, what an earlier step left in the buffer: past topk_length, never to be read), then -1;
    and the length (clamped to 1 when asked)."""
    row = torch.full((width,), -1, dtype=torch.int32)
    n = len(chosen)
    row[:n] = tok[chosen].to(torch.int32)
    length = max(n, 1) if clamp1 else n  # clamped: an empty list keeps one -1 inside its length
    stale = others[torch.randperm(len(others), generator=g)[: max(0, min(7, width - length))]]
    row[length : length + len(stale)] = stale.to(torch.int32)
    return row, length


def _others(tokens: list, b: int) -> torch.Tensor:
    rest = [t for i, t in enumerate(tokens) if i != b]
    return torch.cat(rest) if rest else torch.zeros(0, dtype=torch.long)


def build_case(p: SparsePreset) -> SparseCase:
    g = torch.Generator().manual_seed(p.seed)
    B, L = len(p.seq_lens), LAYOUTS[p.kv_layout]
    main, main_tok = _paged_pool(list(p.seq_lens), p.kv_layout, p.page_size, g, amax_scales=p.scales == "amax")
    rows, lens = [], []
    for b, n in enumerate(p.seq_lens):
        if p.window is not None:  # V4: the window, positions in order
            chosen = torch.arange(max(0, n - p.window), n)
        else:  # V3.2: the indexer's top-k, in its own order
            chosen = torch.randperm(n, generator=g)[: min(n, p.topk)]
        row, ln = _index_list(main_tok[b], chosen, p.topk, _others(main_tok, b), clamp1=False, g=g)
        rows.append(row)
        lens.append(ln)
    case = SparseCase(preset=p, q=(torch.randn(B, 1, p.heads, L.head_dim, generator=g)).to(torch.bfloat16),
                      main=main, indices=torch.stack(rows)[:, None], topk_length=torch.tensor(lens, dtype=torch.int32),
                      sink=(torch.randn(p.heads, generator=g) * 2).float() if p.sink else None)  # fmt: skip
    if p.has_extra:
        _add_extra(case, p, g)
    return case


def _add_extra(case: SparseCase, p: SparsePreset, g: torch.Generator) -> None:
    counts = [n // p.compress_ratio for n in p.seq_lens]
    extra, tok = _paged_pool(counts, p.kv_layout, p.extra_page_size, g)
    rows, lens = [], []
    for b, n in enumerate(counts):
        chosen = torch.randperm(n, generator=g)[: min(n, p.extra_topk)]
        row, ln = _index_list(tok[b], chosen, p.extra_topk, _others(tok, b), clamp1=True, g=g)
        rows.append(row)
        lens.append(ln)
    case.extra, case.extra_indices = extra, torch.stack(rows)[:, None]
    case.extra_topk_length = torch.tensor(lens, dtype=torch.int32)


__all__ = ["Pool", "SparseCase", "build_case"]
