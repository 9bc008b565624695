"""The chunked-prefix prefill capture (meta ``mode`` ``chunked_prefill``, docs/contract.md
"Chunked-prefix prefill captures"): one layer's MHA prefill over a cached prefix taken in chunks
(SGLang's ``forward_normal_chunked_kv_core`` / ``_chunked_prefix_attn_mha``): the query, every
piece's keys and values as its attention got them, each piece's (out, lse), each merge's output.

Tensors (``T`` new tokens = query rows, ``H`` heads, ``Dq`` the q/k width, ``Dv`` the value width,
``B`` requests, ``C`` prefix chunks, ``N`` prefix keys over all chunks):

    q                        [T, H, Dq]     the query rows, request after request
    new_k, new_v             [T, H, Dq], [T, H, Dv]  the new tokens' keys / values (the causal piece)
    new_out, new_lse         [T, H, Dv], [T, H]      that piece's attention (bottom-right causal, per request)
    chunk_k, chunk_v         [N, H, Dq], [N, H, Dv]  the prefix chunks' keys / values: chunk after
                                            chunk, request after request within a chunk
    chunk_out, chunk_lse     [C, T, H, Dv], [C, T, H]  each chunk's attention (not causal)
    step_out, step_lse       [C-1, T, H, Dv], [C-1, T, H]  the merges before the last (absent when C is 1)
    out, lse                 [T, H, Dv], [T, H]  the last merge's output: what the layer went on with
    extend_lens, prefix_lens [B] int        new tokens / cached prefix tokens per request
    chunk_starts, chunk_lens [C, B] int     each chunk's first prefix position and length per request

Merge step i joins chunk i (piece ``a``) into what was merged before (piece ``b``: the new tokens'
piece for step 0, step i-1's output after); lse in the base of meta ``lse_base``. Row ranges are
``qo_indptr`` = cumsum(extend_lens); chunk i's keys of request b are the chunk_lens[i, b] rows of
``chunk_k`` from sum(chunk_lens[:i]) + sum(chunk_lens[i, :b]). Every inconsistency is a
:class:`~refmla.capture.CaptureError` naming the file and the tensor or key.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Optional

import torch

from refmla.capture.format import CaptureError
from refmla.capture.kinds import KindCapture, KindMeta
from refmla.merge.format import OUT_DTYPES, merger_keys
from refmla.util import dtype_name

MODE = "chunked_prefill"
TENSORS = {"q": True, "new_k": True, "new_v": True, "new_out": True, "new_lse": True, "chunk_k": True,
           "chunk_v": True, "chunk_out": True, "chunk_lse": True, "step_out": False, "step_lse": False,
           "out": True, "lse": True, "extend_lens": True, "prefix_lens": True, "chunk_starts": True,
           "chunk_lens": True}  # fmt: skip
INTS = (torch.int32, torch.int64)


@dataclass
class ChunkedMeta(KindMeta):
    mode: str  # "chunked_prefill"
    merger: str  # the merge between the pieces, e.g. "sglang.merge_state"
    sm_scale: float  # the softmax scale every piece's attention was given
    lse_base: str = "e"  # LSE_BASES: the base of every lse in the capture
    attention: Optional[str] = None  # who ran the pieces, e.g. "sglang.forward_normal_chunked_kv_core"
    attn_backend: Optional[str] = None  # the attention backend's class

    def summary(self) -> str:
        return f"attention {self.attention or '?'}  merger {self.merger}  lse base {self.lse_base}{self.where()}"


def parse_chunked_meta(raw: Any, path: Any) -> ChunkedMeta:
    """The meta of a chunked-prefill capture, every key checked; CaptureError names the key."""
    keys = merger_keys(raw, path, MODE)
    scale = raw.get("sm_scale")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not (math.isfinite(scale) and scale > 0):
        raise CaptureError(path, "meta key 'sm_scale'", f"expected a positive finite number, got {scale!r}")
    meta = ChunkedMeta(**keys, sm_scale=float(scale))
    meta.read_common(raw, path, strings=("attention", "attn_backend"))
    return meta


@dataclass
class ChunkedCapture(KindCapture):
    meta: ChunkedMeta
    q: torch.Tensor
    new_k: torch.Tensor
    new_v: torch.Tensor
    new_out: torch.Tensor
    new_lse: torch.Tensor
    chunk_k: torch.Tensor
    chunk_v: torch.Tensor
    chunk_out: torch.Tensor
    chunk_lse: torch.Tensor
    out: torch.Tensor
    lse: torch.Tensor
    extend_lens: torch.Tensor
    prefix_lens: torch.Tensor
    chunk_starts: torch.Tensor
    chunk_lens: torch.Tensor
    step_out: Optional[torch.Tensor] = None
    step_lse: Optional[torch.Tensor] = None

    def validate(self) -> None:
        validate(self)

    @property
    def chunks(self) -> int:
        return int(self.chunk_lens.shape[0])

    @property
    def requests(self) -> int:
        return int(self.extend_lens.shape[0])

    @cached_property
    def qo(self) -> list[int]:
        """Row indptr [B + 1]: request b's query rows are qo[b]:qo[b + 1]."""
        return [0, *torch.cumsum(self.extend_lens.long(), 0).tolist()]

    @cached_property
    def request_of_row(self) -> torch.Tensor:
        return torch.repeat_interleave(torch.arange(self.requests), self.extend_lens.long())

    def keys(self, i: int, b: int) -> slice:
        """Rows of ``chunk_k`` / ``chunk_v`` that are chunk i's keys of request b."""
        lens = self.chunk_lens.long()
        start = int(lens[:i].sum()) + int(lens[i, :b].sum())
        return slice(start, start + int(lens[i, b]))

    def step(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Merge step i's output (out [T, H, Dv], lse [T, H])."""
        return (self.out, self.lse) if i == self.chunks - 1 else (self.step_out[i], self.step_lse[i])  # type: ignore[index]

    def before(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """What merge step i merges chunk i into: the new tokens' piece, or step i-1's output."""
        return (self.new_out, self.new_lse) if i == 0 else self.step(i - 1)

    def row_lens(self, i: int) -> torch.Tensor:
        """[T] keys chunk i attends per query row (0: an empty chunk for that row)."""
        return self.chunk_lens[i].long()[self.request_of_row]

    def accumulated_lens(self, i: int) -> torch.Tensor:
        """[T] keys merged before step i per row: the row's causal new keys and chunks 0..i-1."""
        pos = torch.arange(self.q.shape[0]) - torch.tensor(self.qo[:-1], dtype=torch.long)[self.request_of_row]
        return pos + 1 + self.chunk_lens[:i].long().sum(0)[self.request_of_row]

    def coverage_gaps(self) -> list[dict]:
        """The prefix positions no chunk holds ("uncovered") or two chunks hold ("overlap"), per
        request, as {request, start, end, what}; empty when the chunks tile every prefix exactly."""
        gaps = []
        for b in range(self.requests):
            spans = sorted((int(s), int(s) + int(n)) for s, n in zip(self.chunk_starts[:, b], self.chunk_lens[:, b]) if n > 0)
            at = 0
            for s, e in spans:
                if s != at:
                    gaps.append({"request": b, "start": min(s, at), "end": max(s, min(at, e)),
                                 "what": "uncovered" if s > at else "overlap"})  # fmt: skip
                at = max(at, e)
            if at < int(self.prefix_lens[b]):
                gaps.append({"request": b, "start": at, "end": int(self.prefix_lens[b]), "what": "uncovered"})
        return gaps


def _need(cap: ChunkedCapture, name: str, shape: list, dtypes, what: str) -> torch.Tensor:
    t = getattr(cap, name)
    if list(t.shape) != shape or (dtypes is not None and t.dtype not in dtypes) or (dtypes is None and not t.dtype.is_floating_point):
        raise CaptureError(cap.path, f"tensor '{name}'", f"shape {list(t.shape)} {t.dtype}, expected {shape} {what}")
    return t


def validate(cap: ChunkedCapture) -> None:
    """Shapes, dtypes and the layout agree; CaptureError naming the first tensor that does not."""
    q = cap.q
    if q.dim() != 3 or not q.dtype.is_floating_point:
        raise CaptureError(cap.path, "tensor 'q'", f"shape {list(q.shape)} {q.dtype}, expected [T, H, Dq] float")
    T, H, Dq = q.shape
    el = cap.extend_lens
    if el.dim() != 1 or el.dtype not in INTS or bool((el < 0).any()) or int(el.sum()) != T:
        raise CaptureError(cap.path, "tensor 'extend_lens'", f"expected [B] int32 / int64, none negative, summing to T = {T}")
    B = el.shape[0]
    pl = _need(cap, "prefix_lens", [B], INTS, "int32 / int64")
    cl = cap.chunk_lens
    if cl.dim() != 2 or cl.shape[1] != B or cl.shape[0] < 1 or cl.dtype not in INTS or bool((cl < 0).any()):
        raise CaptureError(cap.path, "tensor 'chunk_lens'", f"shape {list(cl.shape)} {cl.dtype}, expected [C >= 1, {B}] int, none negative")
    C, N = cl.shape[0], int(cl.sum())
    cs = _need(cap, "chunk_starts", [C, B], INTS, "int32 / int64")
    past = (cs.long() + cl.long() > pl.long()[None]) & (cl > 0)  # an empty chunk may start anywhere (SGLang's do)
    if bool((pl < 0).any()) or bool((cs < 0).any()) or bool(past.any()):
        raise CaptureError(cap.path, "tensor 'chunk_starts'", "a chunk starts before 0 or ends past its request's prefix_lens")
    Dv = cap.new_v.shape[-1] if cap.new_v.dim() == 3 else -1
    _need(cap, "new_k", [T, H, Dq], None, "float (like q)")
    _need(cap, "new_v", [T, H, Dv], None, "float")
    _need(cap, "chunk_k", [N, H, Dq], None, f"float (N = {N}: chunk_lens summed)")
    _need(cap, "chunk_v", [N, H, Dv], None, "float")
    for name, lead in (("new_out", []), ("chunk_out", [C]), ("out", [])):
        _need(cap, name, [*lead, T, H, Dv], OUT_DTYPES, "bf16 / fp16 / fp32")
    for name, lead in (("new_lse", []), ("chunk_lse", [C]), ("lse", [])):
        _need(cap, name, [*lead, T, H], None, "float")
    for name, shape in (("step_out", [C - 1, T, H, Dv]), ("step_lse", [C - 1, T, H])):
        if getattr(cap, name) is None and C > 1:
            raise CaptureError(cap.path, f"tensor '{name}'", f"missing: required with {C} chunks (the merges before the last)")
        if getattr(cap, name) is not None:
            _need(cap, name, shape, OUT_DTYPES if name == "step_out" else None, "float")
    for name in ("new_lse", "chunk_lse"):
        if bool(torch.isnan(getattr(cap, name)).any()):
            cap.warnings.append(f"{name} holds NaN (an empty chunk returned NaN instead of -inf?)")


def describe(cap: ChunkedCapture) -> dict:
    """What `refmla inspect` says of a chunked-prefill capture: sizes, the layout, the empty chunks."""
    T, H, Dq = cap.q.shape
    empty = [[b for b in range(cap.requests) if int(cap.chunk_lens[i, b]) == 0 and int(cap.extend_lens[b])]
             for i in range(cap.chunks)]  # fmt: skip
    return {"attention": cap.meta.attention, "attn_backend": cap.meta.attn_backend, "merger": cap.meta.merger,
            "lse_base": cap.meta.lse_base, "sm_scale": cap.meta.sm_scale, "rows": T, "heads": H, "qk_dim": Dq,
            "v_dim": int(cap.out.shape[-1]), "requests": cap.requests, "chunks": cap.chunks,
            "extend_lens": cap.extend_lens.tolist(), "prefix_lens": cap.prefix_lens.tolist(),
            "chunk_keys": cap.chunk_lens.sum(1).tolist(), "empty_chunks": {str(i): e for i, e in enumerate(empty) if e},
            "coverage_gaps": cap.coverage_gaps(),
            "dtypes": {"q": dtype_name(cap.q.dtype), "kv": dtype_name(cap.chunk_k.dtype), "out": dtype_name(cap.out.dtype)}}  # fmt: skip


__all__ = ["MODE", "TENSORS", "ChunkedCapture", "ChunkedMeta", "describe", "parse_chunked_meta", "validate"]
