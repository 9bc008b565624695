"""The reference against independent formulations, on hostile paged data."""

import math

import pytest
import torch
import torch.nn.functional as F

from helpers import dense_reference, paged_case
from refmla import reference as ref
from refmla.attended import Attended
from refmla.control import mla_control
from refmla.scales import Scales
from refmla.schedule import split_bounds

LENGTHS = [0, 1, 31, 32, 33, 255, 256, 257, 1300]
SCALE = 0.1309  # Kimi-K2's yarn-scaled sm_scale


@pytest.mark.parametrize("page_size", [1, 16, 64, 256])
@pytest.mark.parametrize("heads", [1, 8, 16, 128])
def test_decode_matches_dense_formulation(page_size, heads):
    q, kv, indptr, idx = paged_case(LENGTHS, heads, page_size, seed=page_size + heads)
    out, lse = ref.mla_decode_ref(q, kv, Attended.token_index(indptr, idx), Scales(kv_lora_rank=512, sm_scale=SCALE))
    want_out, want_lse = dense_reference(q, kv, indptr, idx, 512, SCALE)
    assert out.dtype == torch.float64 and out.shape == (len(LENGTHS), heads, 512)
    assert torch.isfinite(out).all(), "NaN from unattended pool rows leaked into the output"
    torch.testing.assert_close(out, want_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, want_lse, rtol=1e-12, atol=1e-12)


def test_decode_matches_torch_sdpa():
    q, kv, indptr, idx = paged_case([1, 33, 257, 1300], 16, page_size=16, seed=3)
    out, _ = ref.mla_decode_ref(q, kv, Attended.token_index(indptr, idx), Scales(kv_lora_rank=512, sm_scale=SCALE))
    for b in range(4):
        rows = idx[int(indptr[b]) : int(indptr[b + 1])]
        k = kv[rows, 0].double()[None, None].expand(1, 16, -1, -1)  # [1, H, L, D]
        v = k[..., :512]
        want = F.scaled_dot_product_attention(q[b].double()[None, :, None], k, v, scale=SCALE)  # [1, H, 1, Dv]
        torch.testing.assert_close(out[b], want[0, :, 0], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("logit_cap", [0.0, 2.5, 30.0])
def test_logit_cap(logit_cap):
    q, kv, indptr, idx = paged_case([5, 300], 8, seed=11)
    q = q * 4  # large logits so that a cap of 2.5 bites hard
    out, lse = ref.mla_decode_ref(q, kv, Attended.token_index(indptr, idx), Scales(kv_lora_rank=512, sm_scale=SCALE, logit_cap=logit_cap))
    want_out, want_lse = dense_reference(q, kv, indptr, idx, 512, SCALE, logit_cap=logit_cap)
    torch.testing.assert_close(out, want_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, want_lse, rtol=1e-12, atol=1e-12)
    if logit_cap:
        uncapped, _ = ref.mla_decode_ref(q, kv, Attended.token_index(indptr, idx), Scales(kv_lora_rank=512, sm_scale=SCALE))
        assert (out - uncapped).abs().max() > 1e-3, "the cap changed nothing: is it applied?"


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e4m3fnuz])
def test_fp8_kv_with_scales(fp8):
    q, kv, indptr, idx = paged_case([17, 129, 64], 8, page_size=16, seed=5)
    kv8 = (kv / 0.5).to(fp8)  # stored / scale
    out, lse = ref.mla_decode_ref(q, kv8, Attended.token_index(indptr, idx), Scales(kv_lora_rank=512, sm_scale=SCALE, k_scale=0.5, v_scale=0.25))
    want_out, want_lse = dense_reference(q, kv8, indptr, idx, 512, SCALE, k_scale=0.5, v_scale=0.25)
    torch.testing.assert_close(out, want_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, want_lse, rtol=1e-12, atol=1e-12)


def test_non_contiguous_inputs_and_int32_metadata():
    q, kv, indptr, idx = paged_case([40, 3], 8, seed=2)
    wide = torch.full((kv.shape[0], 1, 640), math.nan)
    wide[..., :576] = kv
    kv_view = wide[..., :576]  # rows strided by 640
    q_view = torch.stack([q, torch.full_like(q, math.nan)], dim=2).flatten(1, 2)[:, ::2]  # heads strided by 2
    assert not kv_view.is_contiguous() and not q_view.is_contiguous()
    a = ref.mla_decode_ref(q_view, kv_view, Attended.token_index(indptr.int(), idx.int()), Scales(kv_lora_rank=512, sm_scale=SCALE))
    b = ref.mla_decode_ref(q.contiguous(), kv.contiguous(), Attended.token_index(indptr, idx), Scales(kv_lora_rank=512, sm_scale=SCALE))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_empty_request_gives_zero_and_minus_inf():
    q, kv, indptr, idx = paged_case([0, 7, 0], 4, seed=1)
    out, lse = ref.mla_decode_ref(q, kv, Attended.token_index(indptr, idx), Scales(kv_lora_rank=512, sm_scale=SCALE))
    assert torch.equal(out[0], torch.zeros(4, 512, dtype=torch.float64)) and torch.equal(out[2], out[0])
    assert bool((lse[[0, 2]] == -math.inf).all()) and not torch.isnan(out).any()


def test_head_dims_come_from_arguments_not_constants():
    # a DeepSeek-style 512+64 split is not assumed: 256 latent + 32 rope works the same
    q, kv, indptr, idx = paged_case([9, 70], 4, D=288, seed=9)
    out, lse = ref.mla_decode_ref(q, kv, Attended.token_index(indptr, idx), Scales(kv_lora_rank=256, sm_scale=0.2))
    want, want_lse = dense_reference(q, kv, indptr, idx, 256, 0.2)
    assert out.shape == (2, 4, 256)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)


# --- split-KV -------------------------------------------------------------------------------


@pytest.mark.parametrize("L", [1, 31, 32, 33, 100, 255, 256, 257, 1300])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 7, 16, 41, 64])
def test_split_schedule_is_sglangs(L, n):
    bounds = split_bounds(L, n)
    per = math.ceil(math.ceil(L / n) / 32) * 32
    assert len(bounds) == min(n, math.ceil(L / per)), "exactly the splits that hold a token"
    assert all(e > s for s, e in bounds)
    assert all(s == i * per and e == min((i + 1) * per, L) for i, (s, e) in enumerate(bounds))
    covered = [p for s, e in bounds for p in range(s, max(s, e))]
    assert covered == list(range(L)), "splits must tile [0, L) in order, without overlap"


def test_split_bounds_work_is_bounded_by_the_sequence_not_the_count():
    """num_kv_splits = 2**31 - 1 (hostile capture) must not build 2**31 tuples."""
    import time

    t0 = time.perf_counter()
    bounds = split_bounds(100, 2**31 - 1)
    assert time.perf_counter() - t0 < 0.5
    assert bounds == [(0, 32), (32, 64), (64, 96), (96, 100)]
    assert split_bounds(0, 10**8) == []


def test_split_merge_equals_unsplit_including_trailing_empty_splits():
    lens = [1, 31, 32, 33, 255, 257, 1300, 0]
    q, kv, indptr, idx = paged_case(lens, 8, page_size=16, seed=4)
    want, want_lse = ref.mla_decode_ref(q, kv, Attended.token_index(indptr, idx), Scales(kv_lora_rank=512, sm_scale=SCALE))
    for n in ([1] * 8, [4] * 8, [16] * 8, [41] * 8, [3, 1, 2, 64, 9, 16, 41, 5]):
        splits = torch.tensor(n, dtype=torch.int32)
        parts, lses, valid = ref.mla_decode_split_ref(q, kv, Attended.token_index(indptr, idx), splits, Scales(kv_lora_rank=512, sm_scale=SCALE))
        for b, L in enumerate(lens):  # exactly the non-empty splits are valid
            assert int(valid[b].sum()) == sum(e > s for s, e in split_bounds(L, int(splits[b])))
        out, lse = ref.merge_splits(parts, lses, valid)
        torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-13)
        torch.testing.assert_close(lse, want_lse, rtol=1e-12, atol=1e-13)


def test_merge_without_one_split_changes_the_answer():
    q, kv, indptr, idx = paged_case([300], 4, seed=8)
    splits = torch.tensor([4], dtype=torch.int32)
    parts, lses, valid = ref.mla_decode_split_ref(q, kv, Attended.token_index(indptr, idx), splits, Scales(kv_lora_rank=512, sm_scale=SCALE))
    full, _ = ref.merge_splits(parts, lses, valid)
    valid[0, 1] = False
    partial, _ = ref.merge_splits(parts, lses, valid)
    assert (full - partial).abs().max() > 1e-3


# --- extend and control ---------------------------------------------------------------------


def test_extend_last_token_equals_decode_and_is_causal():
    lens = [5, 40, 129]
    q, kv, indptr, idx = paged_case(lens, 4, seed=12)
    n_new = 3
    qe = torch.randn(3 * n_new, 4, 576, dtype=q.dtype)
    qo = torch.arange(4) * n_new
    out, lse = ref.mla_verify_ref(qe, kv, Attended.token_index(indptr, idx, qo), Scales(kv_lora_rank=512, sm_scale=SCALE))
    for b, L in enumerate(lens):
        for i in range(n_new):  # token i sees positions [0, L - n_new + i]
            sub_ptr = torch.tensor([0, L - n_new + i + 1])
            sub_idx = idx[int(indptr[b]) : int(indptr[b]) + L - n_new + i + 1]
            want, want_lse = ref.mla_decode_ref(qe[b * n_new + i][None], kv, Attended.token_index(sub_ptr, sub_idx), Scales(kv_lora_rank=512, sm_scale=SCALE))
            torch.testing.assert_close(out[b * n_new + i], want[0], rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_control_is_rounding_noise_and_not_zero(dtype):
    q, kv, indptr, idx = paged_case([1, 64, 1000], 8, page_size=64, dtype=dtype, seed=6)
    truth, truth_lse = ref.mla_decode_ref(q, kv, Attended.token_index(indptr, idx), Scales(kv_lora_rank=512, sm_scale=SCALE))
    ctl, ctl_lse = mla_control(q, kv, Attended.token_index(indptr, idx), Scales(kv_lora_rank=512, sm_scale=SCALE), dtype)
    assert ctl.dtype == dtype
    err = (ctl.double() - truth).abs().max()
    eps = torch.finfo(dtype).eps
    assert 0 < err < 8 * eps * truth.abs().max(), "control error should be a few ulps of the output"
    torch.testing.assert_close(ctl_lse.double(), truth_lse, rtol=1e-5, atol=1e-5)
