"""The MR region check on any pool: every buffer the pool registers (its own get_contiguous_buf_infos()),
the largest decides. The seed's DeepSeek-V4-Flash numbers, and SGLang 0.5.23's real V4 pool on CPU."""

from __future__ import annotations

import pytest

from refmla.capture import CaptureError, parse_meta
from refmla.hook.geometry import registered_regions
from refmla.region_check import DEFAULT_MR_LIMIT, check_region, compressed_bytes_per_token, compressed_regions

BASE = {"mode": "decode", "backend": "triton", "kv_lora_rank": 512, "qk_rope_head_dim": 64,
        "sm_scale": 0.1, "logit_cap": 0.0, "page_size": 256}  # fmt: skip
ROW = (448 + 64) * 2  # DeepSeek-V4-Flash's compressed row in bf16: 1024 bytes
RATIOS = [0, 0, 4, 128, 4, 128, 4]  # dense layers first, then C4 / C128 (the model's compress_ratios pattern)


def meta(**extra):
    return parse_meta({**BASE, **extra})


def test_seed_dsv4_flash_largest_region_is_256_bytes_per_token():
    assert compressed_bytes_per_token(ROW, 4) == 256 and compressed_bytes_per_token(ROW, 128) == 8
    r = check_region(meta(**compressed_regions(8_551_168, 256, ROW, RATIOS)))
    assert r.source == "get_contiguous_buf_infos" and r.regions == 5 and r.bytes_per_token == 256
    assert r.region_bytes == 8_551_168 * 256 and r.region_index == 0  # the first C4 buffer, not the C128 one


@pytest.mark.parametrize("tokens,band,gb", [(8_551_168, "registers", 2.19), (23_448_064, "fails", 6.0)])
def test_seed_outcomes_under_the_default_clamp(tokens, band, gb):
    """The seed: 8551168 tokens (2.19 GB) registered on MI355X, 23448064 (6.0 GB) did not."""
    r = check_region(meta(**compressed_regions(tokens, 256, ROW, RATIOS)))
    assert r.band == band and round(r.region_bytes / 1e9, 2 if gb < 3 else 1) == gb
    assert r.limit_source == "default" and str(r.region_bytes) in r.message
    assert r.is_finding == (band == "fails")


def test_the_default_2_gib_clamp_caps_at_8388096_tokens():
    r = check_region(meta(**compressed_regions(8_551_168, 256, ROW, RATIOS)))
    assert r.limit_bytes == DEFAULT_MR_LIMIT and r.status == "ok" and "registers above SGLang's clamp" in r.message
    fits = r.fits_max_total_num_tokens
    assert fits == 8_388_096 and str(fits) in r.message
    assert (fits + 256) * 256 < DEFAULT_MR_LIMIT <= (fits + 512) * 256
    assert check_region(meta(**compressed_regions(fits, 256, ROW, RATIOS))).band == "under_clamp"


def test_a_larger_env_clamp_does_not_make_a_failing_region_register():
    r = check_region(meta(**compressed_regions(23_448_064, 256, ROW, RATIOS), mori_max_mr_bytes=8 << 30))
    assert r.status == "finding" and r.limit_source == "SGLANG_MORI_MAX_MR_BYTES"


def test_compress_ratio_0_is_no_region_not_a_division_by_zero():
    assert compressed_bytes_per_token(ROW, 0) is None
    assert compressed_regions(1024, 256, ROW, [0, 0])["kv_pool_region_bytes"] == []
    r = check_region(meta(**compressed_regions(1024, 256, ROW, [0, 4])))
    assert r.regions == 1 and r.status == "ok"


@pytest.mark.parametrize("bad", [{"kv_pool_region_bytes": [1, 2]},
                                 {"kv_pool_region_bytes": [1], "kv_pool_region_item_bytes": [0]},
                                 {"kv_pool_region_bytes": [1, 2], "kv_pool_region_item_bytes": [1]},
                                 {"kv_pool_region_bytes": ["x"], "kv_pool_region_item_bytes": [1]}])  # fmt: skip
def test_bad_region_lists_name_the_key(bad):
    with pytest.raises(CaptureError, match="kv_pool_region"):
        meta(**bad)


class _Raises:
    page_size = 1

    def get_contiguous_buf_infos(self):
        raise NotImplementedError("page-major layout")  # SGLang's own answer for one pool class


def test_a_pool_that_cannot_say_gives_only_its_class():
    assert registered_regions(_Raises()) == {"kv_pool_class": "_Raises"}
    assert registered_regions(object()) == {"kv_pool_class": "object"}


@pytest.fixture(scope="module")
def v4_pool():
    import dsv4_kit

    try:
        return dsv4_kit.token_to_kv_pool(compression_ratios=[0, 4, 128, 4])
    except dsv4_kit.Unavailable as e:
        pytest.skip(str(e))


def test_sglang_v4_pool_read_through_the_hook_equals_its_buf_infos(v4_pool):
    got = registered_regions(v4_pool)
    _, lens, items = v4_pool.get_contiguous_buf_infos()
    assert got["kv_pool_class"] == "DeepSeekV4TokenToKVPool" and got["kv_pool_page_size"] == v4_pool.page_size
    assert got["kv_pool_region_bytes"] == list(lens) and got["kv_pool_region_item_bytes"] == list(items)
    assert len(lens) >= 3 and len(set(lens)) > 1  # C4 KV, C4 indexer, C128 KV: buffers of different sizes
    r = check_region(meta(**got))
    assert r.region_bytes == max(lens) and r.row_bytes == items[lens.index(max(lens))]
    small = check_region(meta(**got, mori_max_mr_bytes=max(lens)))  # a clamp exactly at the largest region
    assert small.band == "registers" and len(small.buffers) == len(lens)
    # the first buffer alone (what the old geometry took for every region) is not the largest here
    assert lens[0] < max(lens)
