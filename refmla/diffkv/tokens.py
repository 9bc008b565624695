"""Rows paired by what they hold: the token ids of every position (tensor ``kv_token_ids``,
refmla.capture.rows), not the request id.

A KV row at position j is a function of the tokens at positions 0..j, so a decode request's position j
has a counterpart in a prefill capture's request when the two requests hold the same token ids at
every position 0..j: each (decode request, prefill request) pair covers the decode request's positions
[0, m), m their common prefix. That is what a prefix cache, a host tier (SGLang HiCache L2, vLLM's CPU
offload) or an L3 store hands back: a request whose prefix came back under another rid is compared
with the capture that first wrote those tokens (the owner rule of refmla.diffkv.pairing: the capture
whose new tokens include j, else the last one that holds it).

    pair_by_tokens  the Pairing (``by == "tokens"``) when every capture has kv_token_ids
    Reuse           a token-paired request's extras: the rids and captures its rows come from, the
                    positions no capture holds, and the origin (kv_origin) of its compared and its
                    mismatched rows -- the tier that a wrong row came back from
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from refmla.capture import Capture
from refmla.capture.rows import ORIGINS, TIER_TEXT, UNKNOWN, origins_of, tokens_of
from refmla.diffkv.pairing import PairedRequest, Pairing, Source
from refmla.diffkv.runs import ranges


def tokens_known(prefill: list[Capture], decode: Capture) -> bool:
    """Every capture of the diff records the token ids of its rows."""
    return all(getattr(c, "kv_token_ids", None) is not None for c in [*prefill, decode])


@dataclass
class TokenPaired(PairedRequest):
    """A decode request paired by tokens; ``source_rids[i]``: the rid of sources[i]'s request."""

    source_rids: list = field(default_factory=list)


def _common_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    """Positions 0..m-1 hold the same known token ids in ``a`` and ``b`` (-1 is never equal)."""
    n = min(a.numel(), b.numel())
    same = (a[:n] == b[:n]) & (a[:n] >= 0)
    off = torch.nonzero(~same).flatten()
    return int(off[0]) if off.numel() else n


def pair_by_tokens(prefill: list[Capture], decode: Capture) -> Pairing:
    """Each decode request with every prefill request it shares a token prefix with (module docstring)."""
    by_first: dict[int, list[tuple[int, int, torch.Tensor]]] = {}  # first token id -> the prefill requests starting with it
    for ci, c in enumerate(prefill):
        for b in range(c.batch_size):
            tp = tokens_of(c, b)
            if tp.numel() and int(tp[0]) >= 0:
                by_first.setdefault(int(tp[0]), []).append((ci, b, tp))
    used: set[tuple[int, int]] = set()
    reqs: list[PairedRequest] = []
    for d in range(decode.batch_size):
        td, rid = tokens_of(decode, d), decode.rid(d)
        r = TokenPaired(rid if rid is not None else d, rid, d)
        for ci, b, tp in by_first.get(int(td[0]), []) if td.numel() else []:
            m = _common_prefix(td, tp)
            if m == 0:
                continue
            s = Source.of(ci, prefill[ci], b)
            r.sources.append(Source(ci, b, m, (min(s.new[0], m), min(s.new[1], m))))
            r.source_rids.append(prefill[ci].rid(b))
            used.add((ci, b))
        reqs.append(r)
    for ci, c in enumerate(prefill):
        for b in range(c.batch_size):
            if (ci, b) not in used:
                rid = c.rid(b)
                reqs.append(PairedRequest(rid if rid is not None else f"{c.path}#{b}", rid, None, [Source.of(ci, c, b)]))
    note = "paired by the token ids the rows hold (kv_token_ids), not by rid: a prefix reused under another rid is compared with the capture that wrote it"
    return Pairing("tokens", reqs, [note])


@dataclass
class WrittenBy:
    """Decode positions whose compared row is a prefill capture's request's row."""

    capture: int
    rid: Optional[str]
    ranges: list  # [start, end) runs of the decode request's positions

    def to_json(self) -> dict:
        return {"capture": self.capture, "rid": self.rid, "positions": [list(x) for x in self.ranges]}


@dataclass
class Reuse:
    """What a token-paired request's rows are, beyond the diff's counts."""

    written_by: list[WrittenBy]
    unmatched: list  # [start, end) runs of positions no prefill capture holds (no counterpart: not compared)
    origins: dict  # origin name -> compared positions whose decode-side row came that way
    mismatch_origins: dict  # origin name -> mismatched positions whose decode-side row came that way
    mismatch_pages: dict  # origin name -> the pages (decode page_size) of those mismatches

    @property
    def tier(self) -> Optional[str]:
        """The origin most mismatched rows came back from (None: no mismatch or none recorded)."""
        known = {k: v for k, v in self.mismatch_origins.items() if k != "unknown"}
        return max(known, key=known.get) if known else None

    def text(self, label, n: int) -> str:
        """The reuse part of a request's summary line."""
        tier = self.tier
        if tier is None:
            return ""
        pages = self.mismatch_pages[tier]
        other = [w for w in self.written_by if w.rid is not None and w.rid != label]
        whom = f" written by {', '.join(sorted({str(w.rid) for w in other}))}" if other else ""
        where = f"page{'s' if len(pages) > 1 else ''} {', '.join(str(p) for p in pages[:8])}"
        return f"{self.mismatch_origins[tier]} of {n} mismatched rows came back from {TIER_TEXT[tier]} ({where}); they differ from the rows{whom}"

    def to_json(self) -> dict:
        return {"written_by": [w.to_json() for w in self.written_by], "unmatched_positions": [list(x) for x in self.unmatched],
                "origins": dict(self.origins), "mismatch_origins": dict(self.mismatch_origins),
                "mismatch_pages_by_origin": {k: list(v) for k, v in self.mismatch_pages.items()},
                "tier": self.tier}  # fmt: skip


def reuse_of(r: TokenPaired, n: int, held: torch.Tensor, pos: torch.Tensor, decode: Capture, page: int) -> Reuse:
    """``r``'s Reuse: ``n`` positions planned, ``held`` [n] those compared, ``pos`` the mismatched ones."""
    owner = r.owner[:n]
    written = [WrittenBy(s.cap, r.source_rids[i], ranges(torch.nonzero((owner == i) & held).flatten()))
               for i, s in enumerate(r.sources)]  # fmt: skip
    covered = torch.zeros(int(decode.seq_lens[r.decode_b]), dtype=torch.bool)
    covered[:n] = owner >= 0
    org = origins_of(decode, r.decode_b)[:n].clamp(min=UNKNOWN)  # [n] the decode row's origin code per position
    codes = {name: code for code, (name, _) in ORIGINS.items()} | {"unknown": UNKNOWN}

    def count(at: torch.Tensor) -> dict:
        return {name: k for name, code in codes.items() if (k := int((org[at] == code).sum()))}

    mo = count(pos)
    pages = {name: torch.unique(pos[org[pos] == codes[name]] // page).tolist() for name in mo}
    return Reuse([w for w in written if w.ranges], ranges(torch.nonzero(~covered).flatten()),
                 count(torch.nonzero(held).flatten()), mo, pages)  # fmt: skip


__all__ = ["Reuse", "TokenPaired", "WrittenBy", "pair_by_tokens", "reuse_of", "tokens_known"]
