"""seq_len_off_by {"delta": k}: the kernel attended seq_len + k tokens, k in -4..4, k != 0.

Per request: each delta is recomputed on the request's rows (k > 0 reads the rows after its end,
when the capture can say which they are), and every one that screens is confirmed: the smallest
|k| that the comparator passes is reported, the others that pass are its ``alternatives`` (the
last tokens of a long request may weigh too little to tell -1 from -3).
"""

from __future__ import annotations

from typing import Iterator, Optional

import torch

from refmla.hypotheses.drivers import per_request, rescore
from refmla.hypotheses.search import SCREEN, Candidate, Search
from refmla.results import Explanation

NAME = "seq_len_off_by"
DELTAS = (-1, 1, -2, 2, -3, 3, -4, 4)  # simplest first


def search(s: Search) -> Optional[Explanation]:
    return per_request(s, NAME, find_seq_len, limit=None)


def find_seq_len(s: Search, b: int) -> Iterator[Candidate]:
    r = s.req(b)
    cands = []
    for k in DELTAS:
        if k < 0 and int(r.vis.min()) + k < 0:
            continue
        seq = r.pool_rows
        if k > 0:
            nxt = extra_rows(s, b, k)
            if nxt is None:
                continue
            seq = torch.cat([seq, nxt])
        exp, ctl = s.attend_rows(b, seq, r.vis + k)
        cands.append(Candidate({"delta": k}, exp, ctl, rescore(s, b, exp), simplicity=(abs(k), DELTAS.index(k))))
    yield from sorted((c for c in cands if c.score < SCREEN), key=lambda c: c.score)


def extra_rows(s: Search, b: int, k: int) -> Optional[torch.Tensor]:
    """The k pool rows after request b's last position, or None when the capture cannot say.

    req_to_token[b, L:L+k] when the capture has them; positions L..L+k-1 through the block table
    (its padding entries too: a kernel that reads past the table reads those pages, vLLM #51065);
    else the next slots of the last page when page_size > 1 and they stay inside it.
    """
    cap, r = s.cap, s.req(b)
    L, N = r.L, cap.kv_buffer.shape[0]
    if cap.block_table is not None:
        P = cap.meta.page_size
        pos = torch.arange(L, L + k)
        if int(pos[-1]) // P < cap.block_table.shape[1]:
            nxt = cap.block_table[b].long()[pos // P] * P + pos % P
            if bool(((nxt >= 0) & (nxt < N)).all()):
                return nxt
    if cap.req_to_token is not None and cap.req_to_token.shape[1] >= L + k:
        nxt = cap.req_to_token[b, L : L + k].long()
        if bool(((nxt >= 0) & (nxt < N)).all()):
            return nxt
    P = cap.meta.page_size
    if P > 1 and L > 0:
        last = int(r.pool_rows[-1])
        if last % P + k < P and last + k < N:
            return torch.arange(last + 1, last + k + 1)
    return None
