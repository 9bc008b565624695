"""rope_mishandled {"how"}: q . k did not pair the latent and rope parts as the cache stores them.

Whole output. A row of the cache is [c_kv (kv_lora_rank) | k_pe (qk_rope_head_dim)] and q is
[q_nope absorbed (kv_lora_rank) | q_pe (qk_rope_head_dim)]. The kernel computed q' . k with

    rope ignored              q' = [q_nope | 0]        q . k over the latent dims only
    latent ignored            q' = [0 | q_pe]          over the rope dims only
    q rope and latent swapped q' = [q_pe | q_nope]     q concatenated in the other order
    k rope and latent swapped q' . [k_pe | c_kv]       K read as [rope | latent] (V still the latent)

Each is screened on the worst request (fp64) and the survivors confirmed on the whole output,
recomputed with q' (the same reference and control as for the capture's q).
"""

from __future__ import annotations

from typing import Callable, Iterator, Optional

import torch

from refmla import reference as ref
from refmla.hypotheses.drivers import global_hypothesis, rescore
from refmla.hypotheses.scalars import full_under
from refmla.hypotheses.search import SCREEN, Candidate, Search
from refmla.results import Explanation

NAME = "rope_mishandled"


def variants(Dv: int, R: int) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """how -> q [..., Dv + R] to the q' the kernel's q . k amounts to."""

    def only(lo: int, hi: int) -> Callable[[torch.Tensor], torch.Tensor]:
        def f(q: torch.Tensor) -> torch.Tensor:
            out = torch.zeros_like(q)
            out[..., lo:hi] = q[..., lo:hi]
            return out

        return f

    return {
        "rope ignored": only(0, Dv),
        "latent ignored": only(Dv, Dv + R),
        "q rope and latent swapped": lambda q: torch.cat([q[..., Dv:], q[..., :Dv]], -1),
        "k rope and latent swapped": lambda q: torch.cat([q[..., R:], q[..., :R]], -1),
    }


def search(s: Search) -> Optional[Explanation]:
    cap = s.cap
    Dv, R = s.sc.kv_lora_rank, cap.meta.qk_rope_head_dim
    if R < 1 or cap.meta.head_dim != Dv + R or not s.req(s.worst_request).L:
        return None
    r = s.req(s.worst_request)
    scored = []
    for pref, (how, f) in enumerate(variants(Dv, R).items()):
        exp = attend_q(s, f(r.q64), r.kv64, r.vis)
        scored.append((rescore(s, r.b, exp), pref, how, f))
    ok = sorted((x for x in scored if x[0] <= 1.0), key=lambda x: x[1])
    rest = sorted((x for x in scored if 1.0 < x[0] < SCREEN), key=lambda x: x[0])

    def candidates() -> Iterator[Candidate]:
        for _, _, how, f in ok + rest:
            exp, ctl = full_under(s, s.sc, q=f(cap.q))
            yield Candidate({"how": how}, exp, ctl, extra={"kv_lora_rank": Dv, "qk_rope_head_dim": R})

    return global_hypothesis(s, NAME, candidates())


def attend_q(s: Search, qk: torch.Tensor, kv64: torch.Tensor, vis: torch.Tensor) -> torch.Tensor:
    """One request's fp64 output [T, H, Dv] with logits from q' = ``qk`` [T, H, D]."""
    out = torch.empty(qk.shape[0], qk.shape[1], s.sc.kv_lora_rank, dtype=torch.float64)
    for t in range(qk.shape[0]):
        out[t] = ref.attend(qk[t], kv64[: int(vis[t])], s.sc)[0]
    return out
