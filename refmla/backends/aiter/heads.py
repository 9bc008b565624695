"""Head padding: aiter's MLA decode kernels want 16 heads or a multiple of 16.

For H < 16 dividing 16, q is ``repeat_interleave(16 // H)`` along heads and the output read back at
every factor-th head (``o[:, ::factor]``); other H < 16 are zero-padded to 16 and read back as
``o[:, :H]``. (SGLang 0.5.23 tiles instead, ``q.repeat(1, 16 // H, 1)`` then ``o[:, :H]``: the same
heads. The bug docs/contract.md section 4 names ``head_misaligned`` is mixing the two: interleave,
then ``[:H]``.)

Callers use ``heads.pad_heads`` by attribute, so a test can patch this one function.
"""

from __future__ import annotations

from typing import Callable

import torch

AITER_HEADS = 16  # the smallest head count aiter's MLA decode kernels take


def pad_heads(q: torch.Tensor) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor], str]:
    """q [B, H, D] -> (q for the kernel [B, max(H, 16), D], output [B, Hk, Dv] -> [B, H, Dv], how)."""
    H = q.shape[1]
    if H >= AITER_HEADS:
        return q, (lambda o: o), "none"
    if AITER_HEADS % H == 0:
        f = AITER_HEADS // H
        return q.repeat_interleave(f, dim=1), (lambda o: o[:, ::f]), f"repeat_interleave({f}), output [::{f}]"
    padded = q.new_zeros(q.shape[0], AITER_HEADS, q.shape[2])
    padded[:, :H] = q
    return padded, (lambda o: o[:, :H]), f"zero-padded to {AITER_HEADS}, output [:{H}]"


__all__ = ["AITER_HEADS", "pad_heads"]
