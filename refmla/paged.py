"""Index conventions for a paged KV pool, and the converter between them.

SGLang (token level): ``kv_indices`` lists one pool slot per token, in position order; slot
``t`` lives in page ``t // page_size`` at offset ``t % page_size``.

aiter (page level): ``kv_page_indptr`` [B + 1] over pages, ``kv_page_indices`` the page ids in
order, ``kv_last_page_lens`` [B] the tokens used in each request's last page (1..page_size).
Position ``j`` of request ``b`` is slot ``kv_page_indices[kv_page_indptr[b] + j // P] * P + j % P``.
"""

from __future__ import annotations

import torch


def token_to_page(
    kv_indptr: torch.Tensor, kv_indices: torch.Tensor, page_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """SGLang token slots -> aiter (kv_page_indptr, kv_page_indices, kv_last_page_lens).

    Raises ValueError when a request's slots are not page-aligned (position j must sit at
    offset j % page_size of its page, and a page's tokens must be consecutive slots).
    """
    P = int(page_size)
    lens = (kv_indptr[1:] - kv_indptr[:-1]).long()  # [B]
    page_indptr = torch.zeros(len(lens) + 1, dtype=torch.int64)
    page_indptr[1:] = torch.cumsum((lens + P - 1) // P, 0)
    pages, last = [], []
    for b, L in enumerate(lens.tolist()):
        slots = kv_indices[int(kv_indptr[b]) : int(kv_indptr[b]) + L].long()  # [L]
        pos = torch.arange(L)
        if L and not torch.equal(slots % P, pos % P):
            j = int(torch.nonzero(slots % P != pos % P)[0])
            raise ValueError(f"request {b}: position {j} is at slot {int(slots[j])}, not page-aligned for page_size {P}")
        first = slots[::P] // P  # [ceil(L/P)] the page of each page's first token
        if L and not torch.equal(slots // P, first.repeat_interleave(P)[:L]):
            raise ValueError(f"request {b}: a page's tokens are not in one page (page_size {P})")
        pages.append(first)
        last.append(L - (len(first) - 1) * P if L else 0)
    page_indices = torch.cat(pages) if pages else torch.zeros(0, dtype=torch.int64)
    return page_indptr, page_indices, torch.tensor(last, dtype=torch.int64)


def page_to_token(
    kv_page_indptr: torch.Tensor,
    kv_page_indices: torch.Tensor,
    kv_last_page_lens: torch.Tensor,
    page_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """aiter page-level -> SGLang (kv_indptr, kv_indices) token slots."""
    P = int(page_size)
    npages = (kv_page_indptr[1:] - kv_page_indptr[:-1]).long()  # [B]
    lens = torch.where(npages > 0, (npages - 1) * P + kv_last_page_lens.long(), 0)  # [B]
    kv_indptr = torch.zeros(len(lens) + 1, dtype=torch.int64)
    kv_indptr[1:] = torch.cumsum(lens, 0)
    slots = []
    for b, L in enumerate(lens.tolist()):
        pg = kv_page_indices[int(kv_page_indptr[b]) : int(kv_page_indptr[b + 1])].long()
        slots.append((pg[:, None] * P + torch.arange(P)[None, :]).reshape(-1)[:L])
    kv_indices = torch.cat(slots) if slots else torch.zeros(0, dtype=torch.int64)
    return kv_indptr, kv_indices
