"""What each attended row holds and where it came from (docs/contract.md section 1, "row tokens"):
two optional tensors laid out like ``kv_indices``, so entry ``kv_indptr[b] + j`` describes position
``j`` of request ``b`` (positions are the order ``kv_indices`` lists them in, as everywhere):

    kv_token_ids  [kv_indptr[-1]] int32 / int64: the token id the row at that position was computed
                  for (-1: the engine did not know it)
    kv_origin     [kv_indptr[-1]] int8 / int32 / int64: how the row got into the pool the kernel read,
                  one of :data:`ORIGINS` by its code (-1: unknown)

With both sides' token ids a diff-kv pairs rows by the tokens they hold (refmla.diffkv.tokens), not by
the request id: a request whose prefix came back from a prefix cache, a host tier or an L3 store is
compared with the capture that first wrote those tokens. Captures without them load as before.
Torch only, no refmla import but the capture format: the hook, the checks and the diff read one copy.
"""

from __future__ import annotations

from typing import Optional

import torch

from refmla.capture.format import Capture, CaptureError

# code -> (name, what it means); SGLang's names: cached_tokens_device / _host / _storage of a Req
ORIGINS: dict[int, tuple[str, str]] = {
    0: ("computed", "computed by this request (its prefill or an earlier decode step)"),
    1: ("prefix_cache", "a device prefix-cache hit (SGLang's radix cache, vLLM's prefix caching)"),
    2: ("host", "loaded back from the host tier (SGLang HiCache L2, vLLM's CPU offload)"),
    3: ("storage", "fetched from an L3 store (SGLang HiCache storage: Mooncake, 3FS, file; LMCache)"),
}
UNKNOWN = -1
ORIGIN_CODES = {name: code for code, (name, _) in ORIGINS.items()}
ROW_TENSORS = ("kv_token_ids", "kv_origin")
_DTYPES = {"kv_token_ids": {torch.int32, torch.int64}, "kv_origin": {torch.int8, torch.int32, torch.int64}}


def origin_name(code: int) -> str:
    return ORIGINS[code][0] if code in ORIGINS else "unknown"


TIER_TEXT = {"computed": "rows this request computed", "prefix_cache": "a device prefix-cache hit",
             "host": "the host tier (HiCache L2 / CPU offload)", "storage": "an L3 store (HiCache storage)",
             "unknown": "rows of unknown origin"}  # fmt: skip


def row_tensor_problem(name: str, t: torch.Tensor, n: int, like: str = "kv_indices") -> Optional[str]:
    """What is wrong with row tensor ``name`` of a capture holding ``n`` positions, or None."""
    if t.dtype not in _DTYPES[name]:
        allowed = ", ".join(sorted(str(d).replace("torch.", "") for d in _DTYPES[name]))
        return f"dtype {str(t.dtype).replace('torch.', '')} not allowed here ({allowed})"
    if t.dim() != 1 or t.shape[0] != n:
        return f"shape {list(t.shape)}, expected [{n}] (like {like})"
    if t.numel() and int(t.min()) < -1:
        return f"holds {int(t.min())}; -1 is the only negative (unknown)"
    if name == "kv_origin" and t.numel() and int(t.max()) > max(ORIGINS):
        known = ", ".join(f"{c} {nm}" for c, (nm, _) in ORIGINS.items())
        return f"holds code {int(t.max())}; known codes are -1..{max(ORIGINS)} ({known})"
    return None


def check_row_tokens(cap: Capture, warnings: list[str]) -> None:
    """kv_token_ids / kv_origin, when present: integer, one entry per kv_indices entry, origin codes known."""
    for name in ROW_TENSORS:
        t = getattr(cap, name)
        problem = row_tensor_problem(name, t, cap.kv_indices.shape[0]) if t is not None else None
        if problem:
            raise CaptureError(cap.path, f"tensor '{name}'", problem)


def tokens_of(cap: Capture, b: int) -> torch.Tensor:
    """Request ``b``'s token id per position [seq_len] int64 (requires kv_token_ids)."""
    lo, hi = int(cap.kv_indptr[b]), int(cap.kv_indptr[b + 1])
    return cap.kv_token_ids[lo:hi].long()


def origins_of(cap: Capture, b: int) -> torch.Tensor:
    """Request ``b``'s origin code per position [seq_len] int64; all -1 without kv_origin."""
    lo, hi = int(cap.kv_indptr[b]), int(cap.kv_indptr[b + 1])
    if cap.kv_origin is None:
        return torch.full((hi - lo,), UNKNOWN, dtype=torch.int64)
    return cap.kv_origin[lo:hi].long()


__all__ = ["ORIGINS", "ORIGIN_CODES", "ROW_TENSORS", "UNKNOWN", "check_row_tokens", "origin_name", "origins_of",
           "row_tensor_problem", "TIER_TEXT", "tokens_of"]  # fmt: skip
