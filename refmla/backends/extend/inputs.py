"""The capture as the extend path sees it: each request's cached prefix and its new tokens."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from refmla.attended import Attended
from refmla.capture import Capture


@dataclass
class ExtendInputs:
    """One extend call: prefix through the cache, new tokens' K/V as tensors."""

    q_extend: torch.Tensor  # [T, H, D] the new tokens' queries (rows of requests with tokens)
    k_extend: torch.Tensor  # [T, 1, D] their latent K, dequantized, in q's dtype
    v_extend: torch.Tensor  # [T, 1, Dv] their latent V (first Dv dims), dequantized, in q's dtype
    qo_indptr: torch.Tensor  # [B + 1] int64, request b's new tokens are rows qo_indptr[b]:qo_indptr[b+1]
    prefix_indptr: torch.Tensor  # [B + 1] int64 over prefix_indices
    prefix_indices: torch.Tensor  # [sum(L_b - n_b)] int64 token slots of the prefixes, position order
    out_rows: torch.Tensor  # [T] which row of the capture's `out` each new token is
    num_rows: int  # rows of the capture's `out` (decode: B; extend: T)
    att: Attended  # the capture's: what each query row sees (the new tokens' columns of a tree mask)
    custom_mask: Optional[torch.Tensor] = None  # verify: SGLang's [sum n_b * L_b] mask (see verify_mask)
    mask_indptr: Optional[torch.Tensor] = None  # verify: [B + 1]
    mask_source: Optional[str] = None  # "capture" | "causal (built: a chain's mask)" | None

    def prefix_rows(self, b: int) -> torch.Tensor:
        """[L_b - n_b] int64: request b's cached prefix slots, in position order."""
        return self.prefix_indices[int(self.prefix_indptr[b]) : int(self.prefix_indptr[b + 1])]

    def new_token_visibility(self, b: int) -> torch.Tensor:
        """[n_b, n_b] bool: which of request b's new tokens each new token sees (causal, or the tree)."""
        n = int(self.qo_indptr[b + 1] - self.qo_indptr[b])
        return self.att.visibility(b)[:n, self.att.visibility(b).shape[1] - n :]

    @property
    def max_len_extend(self) -> int:
        n = self.qo_indptr[1:] - self.qo_indptr[:-1]
        return int(n.max()) if n.numel() else 0


def dequant_rows(rows: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Cache rows -> the tensor the layer would have passed: (rows * scale) in ``dtype``."""
    if scale != 1.0 or rows.dtype.itemsize == 1:
        return (rows.to(torch.float32) * scale).to(dtype)
    return rows.to(dtype)


def _indptr(lens: torch.Tensor) -> torch.Tensor:
    """[B] lengths -> [B + 1] int64 offsets from 0."""
    indptr = torch.zeros(lens.shape[0] + 1, dtype=torch.int64)
    indptr[1:] = torch.cumsum(lens, 0)
    return indptr


def _new_tokens(att: Attended) -> tuple[torch.Tensor, list[list[int]], int]:
    """(new tokens per request [B], the capture's `out` rows of each request, rows of `out`);
    decode: one new token per request that has a token."""
    B, n = att.num_groups, att.new_tokens()  # [B]: the split the control's fresh_from reads too
    if att.one_query_per_group:
        return n, [[b] if int(n[b]) else [] for b in range(B)], B
    return n, [list(att.queries(b)) for b in range(B)], att.num_rows


def as_extend(cap: Capture) -> ExtendInputs:
    """Split every request of a capture into its cached prefix and its new tokens.

    Decode: one new token per request with L >= 1 (a zero-length request has no token to
    recompute; its output row stays 0, the reference's value). Extend: the capture's qo_indptr.
    """
    m, att = cap.meta, cap.attended()
    B, Dv = att.num_groups, m.kv_lora_rank
    lens = att.lengths()  # [B]
    n, rows_of_b, num_rows = _new_tokens(att)
    prefix_lens = lens - n  # [B]
    prefix, new = [], []
    for b in range(B):
        rows = att.group_rows(b)  # [L_b]
        prefix.append(rows[: int(prefix_lens[b])])
        new.append(rows[int(prefix_lens[b]) :])
    empty = torch.zeros(0, dtype=torch.int64)
    new_rows = torch.cat(new) if new else empty  # [T]
    out_rows = torch.tensor([r for rs in rows_of_b for r in rs], dtype=torch.int64)
    kv_new = cap.kv_buffer[:, 0].index_select(0, new_rows)  # [T, D] stored dtype
    qd = cap.q.dtype if cap.q.dtype.itemsize >= 2 else torch.bfloat16
    mask, mask_indptr, mask_source = verify_mask(cap, n, lens)
    return ExtendInputs(
        q_extend=cap.q.index_select(0, out_rows),
        k_extend=dequant_rows(kv_new, m.k_scale, qd)[:, None, :],
        v_extend=dequant_rows(kv_new[:, :Dv], m.v_scale, qd)[:, None, :],
        qo_indptr=_indptr(n),
        prefix_indptr=_indptr(prefix_lens),
        prefix_indices=torch.cat(prefix) if prefix else empty,
        out_rows=out_rows,
        num_rows=num_rows,
        att=att,
        custom_mask=mask,
        mask_indptr=mask_indptr,
        mask_source=mask_source,
    )


def verify_mask(cap: Capture, n: torch.Tensor, lens: torch.Tensor):
    """(custom_mask, mask_indptr, source) for a verify capture, None otherwise.

    The capture's tree mask when it has one; for a chain (no mask in the capture, e.g. made on
    aiter), the causal bottom-right mask in SGLang's layout, which is what SGLang's Triton backend
    hands its extend kernel in target_verify (spec_info.custom_mask), so the masked path runs.
    """
    if not getattr(cap, "is_verify", False):
        return None, None, None
    if cap.custom_mask is not None:
        return cap.custom_mask.bool(), cap.mask_indptr.long(), "capture"
    att = cap.attended()
    parts = [att.visibility(b).reshape(-1) for b in range(att.num_groups)]  # [n_b * L_b] each, causal
    mask = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.bool)
    return mask, _indptr(n * lens), "causal (built: a chain's mask)"


def scatter_rows(x: torch.Tensor, inp: ExtendInputs, fill: float = 0.0) -> torch.Tensor:
    """[T, H, ...] of the new tokens -> [R, H, ...] rows of the capture (others ``fill``)."""
    out = x.new_full((inp.num_rows, *x.shape[1:]), fill)
    out[inp.out_rows] = x
    return out


__all__ = ["ExtendInputs", "as_extend", "dequant_rows", "scatter_rows", "verify_mask"]
