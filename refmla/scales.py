"""The scalars besides the tensors that change the math of one attention call, passed whole.

Every reference variant, the control, the hypothesis search and the backends take one
:class:`Scales` (``Capture.scales()`` builds it from the capture's meta); nobody unpacks it into
keywords and packs it back. :func:`read_as` lists the values a kernel reads when it takes an fp32
scale's bytes for another format (bf16, UE8M0): the ``kv_scale_format`` hypotheses' candidates.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class Scales:
    """Everything besides the tensors that changes the math."""

    kv_lora_rank: int  # Dv: value width, 512 for DeepSeek-V3 / Kimi-K2
    sm_scale: float  # softmax scale exactly as passed to the kernel (yarn mscale included)
    logit_cap: float = 0.0  # tanh soft cap, 0 = off
    k_scale: float = 1.0  # fp8 KV dequant scale for K
    v_scale: float = 1.0  # fp8 KV dequant scale for V
    # (attention sinks, DeepSeek-V4: a per-head tensor field here when captures carry them)

    def but(self, **changes) -> "Scales":
        """A copy with some fields changed (a hypothesis's mistaken scale, a golden's v_scale 1)."""
        return replace(self, **changes)


def _fp32_bits(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", x))[0]


def read_as(x: float) -> list[tuple[str, str, float]]:
    """(read, how, value) for each way a kernel may read the fp32 scale ``x``'s bytes; the values that
    differ from ``x`` and are finite and positive."""
    bits = _fp32_bits(x)
    as_bf16 = lambda b: torch.tensor([b], dtype=torch.int16).view(torch.bfloat16).item()  # noqa: E731
    e = (bits >> 23) & 0xFF
    ways = [("bf16", "its high half (truncated)", as_bf16(struct.unpack("<h", struct.pack("<H", bits >> 16))[0])),
            ("bf16", "its low half", as_bf16(struct.unpack("<h", struct.pack("<H", bits & 0xFFFF))[0])),
            ("ue8m0", "its exponent (rounded down to a power of two)", 2.0 ** (e - 127)),
            ("ue8m0", "rounded up to a power of two", 2.0 ** (e - 127 + (1 if bits & 0x7FFFFF else 0))),
            ("ue8m0", "its first byte as the exponent", 2.0 ** ((bits & 0xFF) - 127))]  # fmt: skip
    out = []
    for read, how, v in ways:
        if v == v and 0 < v < float("inf") and v != x and all(v != w for _, _, w in out):
            out.append((read, how, float(v)))
    return out


__all__ = ["Scales", "read_as"]
