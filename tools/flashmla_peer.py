"""FlashMLA's own torch reference for sparse decode, loaded at run time from a FlashMLA checkout the
user points at (``$REFMLA_FLASHMLA_REPO``), and called on a refmla sparse capture.

FlashMLA's ``tests/ref.py`` holds ``ref_sparse_attn_decode(p, t)`` (DeepSeek V3.2's and V4's sparse
decode: the main cache's top-k entries, V4's extra cache, topk_length, the attention sink, lonely
rows) and ``ref_sparse_attn_fwd`` (sparse prefill); no dense decode reference. The file imports
FlashMLA's test library (``from lib import TestParam, ...``), which imports ``flash_mla`` (a CUDA
extension) and ``kernelkit``, so it cannot be imported on a CPU machine. This loader reads the file,
parses it with ``ast`` and executes only ``ref_sparse_attn_decode`` and the module-level functions
it calls, with the file's own imports of the names they use (``torch``); their annotations
(``TestParam``, ``KVScope``: the library's types) are dropped, as annotations do nothing. No other
statement of the file runs, nothing of FlashMLA is copied into refmla, and a name the function
needs that the file binds only through ``lib``, ``flash_mla``, ``kernelkit`` or ``quant`` (or not at
all) is refused with one line naming it (:class:`FlashMLAPeerError`).

What is refmla's here, not FlashMLA's: the call's inputs. The reference takes the caches
dequantized to bf16 as FlashMLA's tests give them (``KVScope.quant_and_dequant_``); this module
dequantizes a capture's packed fp8 caches with refmla's decoder (refmla.sparse.reference.dequantize_bf16)
and passes ``p`` / ``t`` as plain namespaces with the attributes the function reads. A capture with
``inv_rope_freqs`` has the output's rope part rotated back after the call (refmla's inverse_rope),
as SGLang's model does after FlashMLA's kernel.

    peer = load_flashmla_peer("/path/to/FlashMLA")   # the checkout (or REFMLA_FLASHMLA_REPO)
    out, lse = peer.decode(cap)                      # out [B, S, H, Dv] bf16, lse [B, S, H]
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import torch

from refmla.sparse.reference import dequantize_bf16, inverse_rope

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/peer_source.py
from peer_source import commit, load_function  # noqa: E402

ENV = "REFMLA_FLASHMLA_REPO"
FILE = Path("tests") / "ref.py"
ENTRY = "ref_sparse_attn_decode"
NOT_LOADABLE = ("lib", "flash_mla", "kernelkit", "quant")  # FlashMLA's test library and its CUDA extension


class FlashMLAPeerError(ValueError):
    """The checkout cannot give FlashMLA's reference (one line: the file and what is missing)."""


@dataclass(frozen=True)
class FlashMLAPeer:
    fn: Callable  # ref_sparse_attn_decode(p, t) -> (out [b, s_q, h_q, d_v] bf16, lse [b, h_q, s_q])
    path: Path
    functions: tuple[str, ...]  # the functions executed, in file order
    commit: str  # the checkout's HEAD ("" when not a git checkout)

    def decode(self, cap) -> tuple[torch.Tensor, torch.Tensor]:
        """A refmla SparseCapture through FlashMLA's reference: out [B, S, H, Dv], lse [B, S, H]."""
        m = cap.meta
        B, S, H, D = cap.q.shape
        p = SimpleNamespace(h_kv=1, decode=SimpleNamespace(b=B), d_qk=D, s_q=S, h_q=H, d_v=m.head_dim_v)
        main = _scope(cap.k_cache, m.layout, m.page_size, m.kv_fp8_dtype, cap.indices, cap.topk_length)
        extra = None
        if cap.extra_k_cache is not None:
            extra = _scope(cap.extra_k_cache, m.extra_layout, m.extra_page_size, m.kv_fp8_dtype, cap.extra_indices,
                           cap.extra_topk_length)  # fmt: skip
        sink = None if cap.attn_sink is None else cap.attn_sink.float()
        t = SimpleNamespace(kv_scope=main, extra_kv_scope=extra, q=cap.q.to(torch.bfloat16), sm_scale=m.softmax_scale,
                            attn_sink=sink)  # fmt: skip
        out, lse = self.fn(p, t)  # out [B, S, H, Dv], lse [B, H, S]
        if cap.inv_rope_freqs is not None:
            o = inverse_rope(out.reshape(B * S, H, m.head_dim_v).float(), cap.inv_rope_freqs, cap.inv_rope_positions[: B * S])
            out = o.to(out.dtype).reshape(out.shape)
        return out, lse.transpose(1, 2)


def _scope(cache, layout, page: int, fp8: str, indices, topk_length) -> SimpleNamespace:
    """One cache as FlashMLA's KVScope holds it: every token dequantized to bf16 [pages, page, 1, D]."""
    tokens = torch.arange(cache.shape[0] * page)
    keys = dequantize_bf16(cache, layout, page, fp8, tokens).to(torch.bfloat16)  # [N, D]
    return SimpleNamespace(blocked_k=keys.view(cache.shape[0], page, 1, keys.shape[-1]),
                           indices_in_kvcache=indices.long(),
                           topk_length=None if topk_length is None else topk_length.long())  # fmt: skip


def load_flashmla_peer(repo: str | Path) -> FlashMLAPeer:
    """FlashMLA's ref_sparse_attn_decode from ``repo``/tests/ref.py (module docstring)."""
    path = Path(repo) / FILE
    if not path.is_file():
        raise FlashMLAPeerError(f"{path}: no such file ({ENV} must name a FlashMLA checkout)")
    fn, functions = load_function(path, ENTRY, frozenset(NOT_LOADABLE), FlashMLAPeerError, "flashmla_tests_ref",
                                  why="FlashMLA's test library or CUDA extension: not loadable here", unannotated=True)
    return FlashMLAPeer(fn, path, functions, commit(Path(repo)))
