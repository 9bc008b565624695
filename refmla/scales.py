"""The scalars besides the tensors that change the math of one attention call, passed whole.

Every reference variant, the control, the hypothesis search and the backends take one
:class:`Scales` (``Capture.scales()`` builds it from the capture's meta); nobody unpacks it into
keywords and packs it back.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


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


__all__ = ["Scales"]
