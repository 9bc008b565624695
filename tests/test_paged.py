"""SGLang token-slot indices <-> aiter page-level indices."""

import pytest
import torch

from helpers import paged_case
from refmla import reference as ref
from refmla.attended import Attended
from refmla.paged import page_to_token, token_to_page
from refmla.scales import Scales


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_round_trip_and_same_reference(page_size):
    lens = [1, 15, 16, 17, 130, 0]
    q, kv, indptr, idx = paged_case(lens, 4, page_size, seed=page_size)
    pptr, pidx, last = token_to_page(indptr, idx, page_size)
    assert pptr[-1] == sum(-(-L // page_size) for L in lens)
    assert last.tolist() == [(L - 1) % page_size + 1 if L else 0 for L in lens]
    indptr2, idx2 = page_to_token(pptr, pidx, last, page_size)
    assert torch.equal(indptr2, indptr) and torch.equal(idx2, idx.long())
    a = ref.mla_decode_ref(q, kv, Attended.token_index(indptr, idx), Scales(kv_lora_rank=512, sm_scale=0.1))
    b = ref.mla_decode_ref(q, kv, Attended.token_index(indptr2, idx2), Scales(kv_lora_rank=512, sm_scale=0.1))
    assert torch.equal(a[0], b[0])


def test_unaligned_slots_are_rejected():
    indptr = torch.tensor([0, 3])
    idx = torch.tensor([16, 17, 19])  # position 2 is not at offset 2 of its page
    with pytest.raises(ValueError, match="position 2"):
        token_to_page(indptr, idx, 16)


@pytest.mark.parametrize("page_size", [16, 64])
def test_reference_in_aiter_convention(page_size):
    from refmla.reference import mla_decode_ref_pages

    lens = [1, 63, 64, 65, 300]
    q, kv, indptr, idx = paged_case(lens, 8, page_size, seed=3)
    pptr, pidx, last = token_to_page(indptr, idx, page_size)
    pages_view = kv.view(-1, page_size, 1, kv.shape[-1])  # aiter's [num_pages, page_size, 1, D]
    a = mla_decode_ref_pages(q, pages_view, pptr, pidx, last, page_size, Scales(kv_lora_rank=512, sm_scale=0.1))
    b = ref.mla_decode_ref(q, kv, Attended.token_index(indptr, idx), Scales(kv_lora_rank=512, sm_scale=0.1))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert torch.isfinite(a[0]).all()
