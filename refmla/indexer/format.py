"""The indexer capture (meta ``mode`` ``indexer``, docs/contract.md "indexer captures"): one decode
call of DeepSeek's lightning indexer (V3.2 DSA; V4's C4 layers), as SGLang and vLLM run it: the
index query and per-head weights against the indexer's key cache as stored, the top-k it produced.

Tensors (B requests, one query token each; H index heads, D index head dim; K the top-k width):

    q             [B, H, D]   fp8 e4m3 (float8_e4m3fn; e4m3fnuz bits as uint8) or bf16 / fp16 / fp32
                  [B, N, H, D] MTP / speculative decode: N query tokens per request (next_n > 1);
                               then weights, q_scale, indices and prev_indices have one row per
                               token, B * N rows, request-major (b * N + t), as SGLang and vLLM
                               flatten them, and token t of request b scores the entries before
                               (seq_lens[b] - N + 1 + t) // compress_ratio (its own causal bound)
    q_scale       [B, H] fp32 optional: q's per-(request, head) scale, when not folded into weights
    weights       [B, H] float the per-head weights as the logits kernel got them (SGLang and vLLM
                               fold q's scale, the softmax scale and H**-0.5 in)
    k_cache       [P, W] uint8 k_layout fp8: each page holds page_size x D fp8 values, then page_size
                               fp32 scales (DeepGEMM's paged layout, SGLang's and vLLM's); W >= page_size * (D + 4)
                  [P, page_size, D] float  k_layout bf16: keys as stored, no scale
    page_table    [B, M] int  request b's page j of indexer entries (page j holds entries
                               j * page_size ...) is row page_table[b, j] of k_cache; -1 unused
    seq_lens      [B] int     request b's length in tokens, the current token included; the
                               indexer scores entries 0 .. seq_lens[b] // compress_ratio - 1
    indices       [B, K] int  what the call produced; -1 invalid (past the valid count)
    k_cache_pages [P] int     optional: the production page of each captured row of k_cache
    prev_indices  [B, K] int  optional: the same layer's indices of the previous step
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from refmla.capture.format import CaptureError
from refmla.capture.kinds import KindCapture, KindMeta, meta_int

MODE = "indexer"
TENSORS = {"q": True, "q_scale": False, "weights": True, "k_cache": True, "page_table": True, "seq_lens": True,
           "indices": True, "k_cache_pages": False, "prev_indices": False}  # fmt: skip
K_LAYOUTS = ("fp8", "bf16")
INDICES_KINDS = ("positions", "slots")  # entry positions, or k-cache slots page_table[b, p // ps] * ps + p % ps
COMPRESS_RATIOS = (1, 2, 4, 128)  # 1: V3.2 (every token); 4: V4 C4
FP8 = {"float8_e4m3fn": torch.float8_e4m3fn, "float8_e4m3fnuz": torch.float8_e4m3fnuz}
Q_DTYPES = {torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.uint8, torch.bfloat16, torch.float16, torch.float32}
INTS = (torch.int32, torch.int64)


@dataclass
class IndexerMeta(KindMeta):
    mode: str  # "indexer"
    page_size: int  # entries per page of the indexer's key cache (64 in SGLang and vLLM)
    topk: int  # K, the index width (2048 in the model; V4 C4 512)
    compress_ratio: int = 1  # 1 (V3.2), 4 (V4 C4): entries = seq_len // ratio
    indices_kind: str = "positions"  # INDICES_KINDS
    k_layout: str = "fp8"  # K_LAYOUTS
    fp8_dtype: str = "float8_e4m3fn"  # of q (fp8) and the cache's values
    model: Optional[str] = None

    def summary(self) -> str:
        return (f"indexer top-{self.topk}  ratio {self.compress_ratio}  {self.k_layout} cache, pages of "
                f"{self.page_size}  indices as {self.indices_kind}{self.where()}")  # fmt: skip


def parse_indexer_meta(raw: Any, path: Any) -> IndexerMeta:
    """The meta of an indexer capture, every key checked; CaptureError names the key."""
    if not isinstance(raw, dict):
        raise CaptureError(path, "header key 'meta'", "not a JSON object")
    if raw.get("mode") != MODE:
        raise CaptureError(path, "meta key 'mode'", f"expected {MODE!r}, got {raw.get('mode')!r}")
    kw: dict[str, Any] = {"mode": MODE, "page_size": meta_int(raw, "page_size", path, lo=1),
                          "topk": meta_int(raw, "topk", path, lo=1)}  # fmt: skip
    if kw["page_size"] > 1 << 16:
        raise CaptureError(path, "meta key 'page_size'", f"must be in [1, 65536], got {kw['page_size']}")
    ratio = raw.get("compress_ratio", 1)
    if isinstance(ratio, bool) or ratio not in COMPRESS_RATIOS:
        raise CaptureError(path, "meta key 'compress_ratio'", f"must be one of {COMPRESS_RATIOS}, got {ratio!r}")
    kw["compress_ratio"] = int(ratio)
    for key, allowed in (("indices_kind", INDICES_KINDS), ("k_layout", K_LAYOUTS), ("fp8_dtype", tuple(FP8))):
        if raw.get(key) is not None:
            if raw[key] not in allowed:
                raise CaptureError(path, f"meta key '{key}'", f"must be one of {', '.join(allowed)}, got {raw[key]!r}")
            kw[key] = raw[key]
    meta = IndexerMeta(**kw)
    meta.read_common(raw, path, strings=("model",))
    return meta


@dataclass
class IndexerCapture(KindCapture):
    meta: IndexerMeta
    q: torch.Tensor  # [B, H, D]
    weights: torch.Tensor  # [B, H]
    k_cache: torch.Tensor  # [P, W] uint8 | [P, page_size, D]
    page_table: torch.Tensor  # [B, M]
    seq_lens: torch.Tensor  # [B]
    indices: torch.Tensor  # [B, K]
    q_scale: Optional[torch.Tensor] = None  # [B, H]
    k_cache_pages: Optional[torch.Tensor] = None  # [P]
    prev_indices: Optional[torch.Tensor] = None  # [B, K]
    next_n: int = 1  # query tokens per request of a flat() capture's rows (an MTP capture's N)

    def flat(self) -> "IndexerCapture":
        """One row per query token: q [B * N, H, D], each row its request's pages and its own causal
        bound seq_lens[b] - N + 1 + t (``next_n`` N); the capture itself when q is [B, H, D]."""
        if self.q.dim() != 4:
            return self
        B, N, H, D = self.q.shape
        seq = (self.seq_lens.long()[:, None] - N + 1 + torch.arange(N)[None, :]).reshape(-1).to(self.seq_lens.dtype)
        return IndexerCapture(path=self.path, meta=self.meta, q=self.q.reshape(B * N, H, D), weights=self.weights,
                              k_cache=self.k_cache, page_table=self.page_table.repeat_interleave(N, 0), seq_lens=seq,
                              indices=self.indices, q_scale=self.q_scale, k_cache_pages=self.k_cache_pages,
                              prev_indices=self.prev_indices, warnings=list(self.warnings), next_n=N)  # fmt: skip

    def row_label(self, r: int) -> str:
        """"request 3" for a row, "request 1 token 2" for a row of an MTP capture's flat() view."""
        return f"request {r}" if self.next_n == 1 else f"request {r // self.next_n} token {r % self.next_n}"

    def validate(self) -> None:
        problem = first_problem(self)
        if problem is not None:
            raise CaptureError(self.path, *problem)

    @property
    def entries(self) -> torch.Tensor:
        """[B] int64: the entries each request's indexer scores (seq_lens // compress_ratio)."""
        return self.seq_lens.long() // self.meta.compress_ratio

    def q_values(self) -> torch.Tensor:
        """[B, H, D] q as numbers (fp8 bits read in the capture's fp8 dtype), exact."""
        q = self.q.view(FP8[self.meta.fp8_dtype]) if self.q.dtype == torch.uint8 else self.q
        return q


def first_problem(cap: IndexerCapture) -> Optional[tuple[str, str]]:
    """(tensor, reason) of the first inconsistency, or None (an MTP capture: its shape, then its flat() rows)."""
    m, q = cap.meta, cap.q
    if q.dim() == 4:
        B, N = q.shape[:2]
        if N < 1 or not q.dtype in Q_DTYPES:
            return "tensor 'q'", f"shape {list(q.shape)} {q.dtype}, expected [B, N, H, D] fp8 / bf16 / fp16 / fp32"
        s = cap.seq_lens
        if s.dim() != 1 or s.dtype not in INTS or s.shape[0] != B:
            return "tensor 'seq_lens'", f"shape {list(s.shape)} {s.dtype}, expected [{B}] int32 / int64 (one length a request)"
        if bool((s < N - 1).any()):
            return "tensor 'seq_lens'", f"a length below N - 1 = {N - 1}: some query token would have a negative bound"
        if cap.page_table.dim() != 2 or cap.page_table.shape[0] != B:
            return "tensor 'page_table'", f"shape {list(cap.page_table.shape)}, expected [{B}, M] (one row a request)"
        for name in ("weights", "q_scale", "indices", "prev_indices"):
            t = getattr(cap, name)
            if t is not None and (t.dim() != 2 or t.shape[0] != B * N):
                return f"tensor '{name}'", f"shape {list(t.shape)}, expected {B * N} rows (one a query token: B {B} x N {N})"
        return first_problem(cap.flat())
    if q.dim() != 3 or q.dtype not in Q_DTYPES or q.shape[2] < 1:
        return "tensor 'q'", f"shape {list(q.shape)} {q.dtype}, expected [B, H, D] fp8 / bf16 / fp16 / fp32"
    B, H, D = q.shape
    fp8_q = q.element_size() == 1
    for name, t, shape in (("weights", cap.weights, [B, H]), ("q_scale", cap.q_scale, [B, H])):
        if t is not None and (list(t.shape) != shape or not t.dtype.is_floating_point or t.element_size() == 1):
            return f"tensor '{name}'", f"shape {list(t.shape)} {t.dtype}, expected {shape} float"
        if t is not None and not bool(torch.isfinite(t).all()):
            return f"tensor '{name}'", "holds NaN / Inf"
    if cap.q_scale is not None and not fp8_q:
        return "tensor 'q_scale'", "present, but q is not fp8"
    if not bool(torch.isfinite(cap.q_values().float()).all()):
        return "tensor 'q'", "holds NaN / Inf"
    k, ps = cap.k_cache, m.page_size
    if m.k_layout == "fp8":
        if k.dim() != 2 or k.dtype != torch.uint8 or k.shape[1] < ps * (D + 4):
            return "tensor 'k_cache'", (f"shape {list(k.shape)} {k.dtype}, expected [P, >= {ps * (D + 4)}] uint8 "
                                        f"(k_layout fp8: {ps} x {D} fp8 values, then {ps} fp32 scales a page)")  # fmt: skip
    elif k.dim() != 3 or list(k.shape[1:]) != [ps, D] or not k.dtype.is_floating_point or k.element_size() == 1:
        return "tensor 'k_cache'", f"shape {list(k.shape)} {k.dtype}, expected [P, {ps}, {D}] float (k_layout bf16)"
    P = k.shape[0]
    for name, t, n in (("seq_lens", cap.seq_lens, 1), ("page_table", cap.page_table, 2), ("indices", cap.indices, 2)):
        if t.dim() != n or t.dtype not in INTS or t.shape[0] != B:
            return f"tensor '{name}'", f"shape {list(t.shape)} {t.dtype}, expected {n}-D int32 / int64 with {B} rows (q's)"
    if cap.indices.shape[1] != m.topk:
        return "tensor 'indices'", f"{cap.indices.shape[1]} columns, but meta topk is {m.topk}"
    if bool((cap.indices < -1).any()):
        return "tensor 'indices'", "holds a value below -1 (-1 is the only invalid value)"
    if bool((cap.seq_lens < 0).any()):
        return "tensor 'seq_lens'", "holds a negative length"
    pt = cap.page_table
    if bool(((pt < -1) | (pt >= P)).any()):
        return "tensor 'page_table'", f"holds a page outside [-1, {P}) (k_cache's rows)"
    need = (cap.entries + ps - 1) // ps  # [B] pages each request's entries fill
    if B and int(need.max()) > pt.shape[1]:
        b = int(need.argmax())
        return "tensor 'page_table'", (f"request {b} needs {int(need[b])} pages for its {int(cap.entries[b])} "
                                       f"entries, the table has {pt.shape[1]}")  # fmt: skip
    cols = torch.arange(pt.shape[1])
    if bool(((cols[None, :] < need[:, None]) & (pt < 0)).any()):
        b = int(((cols[None, :] < need[:, None]) & (pt < 0)).any(1).nonzero()[0])
        return "tensor 'page_table'", f"request {b}: a page its entries need is -1"
    kp = cap.k_cache_pages
    if kp is not None and (kp.dim() != 1 or kp.dtype not in INTS or kp.shape[0] != P or bool((kp < 0).any())
                           or torch.unique(kp).numel() != P):  # fmt: skip
        return "tensor 'k_cache_pages'", f"expected [{P}] distinct production pages >= 0, one per row of k_cache"
    pi = cap.prev_indices
    if pi is not None and (list(pi.shape) != [B, m.topk] or pi.dtype not in INTS):
        return "tensor 'prev_indices'", f"shape {list(pi.shape)} {pi.dtype}, expected [{B}, {m.topk}] int like indices"
    return None


def describe(cap: IndexerCapture) -> dict:
    """What `refmla inspect` says of an indexer capture: shapes, widths, the produced indices' counts."""
    N = cap.q.shape[1] if cap.q.dim() == 4 else 1
    cap = cap.flat()
    B, H, D = cap.q.shape
    n = cap.entries
    valid = (cap.indices != -1).sum(1)
    want = torch.clamp(n, max=cap.meta.topk)
    return {"requests": B // N, "index_heads": H, "index_head_dim": D, "topk": cap.meta.topk,
            "compress_ratio": cap.meta.compress_ratio, "k_layout": cap.meta.k_layout, "q_dtype": str(cap.q.dtype).split(".")[-1],
            "indices_kind": cap.meta.indices_kind, "max_entries": int(n.max()) if B else 0,
            "requests_with_wrong_count": int((valid != want).sum()),
            "previous_step": cap.prev_indices is not None, "query_tokens": N}  # fmt: skip


__all__ = ["COMPRESS_RATIOS", "FP8", "INDICES_KINDS", "K_LAYOUTS", "MODE", "TENSORS", "IndexerCapture", "IndexerMeta",
           "describe", "first_problem", "parse_indexer_meta"]  # fmt: skip
