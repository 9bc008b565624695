"""Issue 12, validation: every size the work depends on is bounded before any work starts.

Each hostile capture below once passed validation and then crashed, ran out of memory or was
judged as a kernel divergence; now it is invalid: exit 2, one stderr line naming the file and the
tensor or key, for `replay` and `inspect` alike.
"""

import math
import resource
import time

import pytest
import torch

from hostile import error_lines, run_cli, set_tensor, small_capture, write_small
from refmla.capture import CaptureError, read_capture
from refmla.capture.format import MAX_KV_SPLITS, MAX_PAGE_SIZE, SCALE_RANGE


def _meta(key, value):
    def mutate(t, m):
        m[key] = value

    return mutate


def _del_meta(key):
    def mutate(t, m):
        m.pop(key)

    return mutate


def _splits(values, drop_max=False):
    def mutate(t, m):
        t["num_kv_splits"] = torch.tensor(values, dtype=torch.int32)
        if drop_max:
            m.pop("max_kv_splits")

    return mutate


def _no_heads(t, m):
    t["q"], t["out"] = t["q"][:, :0], t["out"][:, :0]


def _q64(t, m):
    t["q"] = t["q"].double()


def _kv64(t, m):
    t["kv_buffer"] = t["kv_buffer"].double()


def _wide_partials(t, m):
    B, H, Dv = t["out"].shape
    t["attn_logits"] = torch.zeros(B, H, 5, Dv)  # 5 > max_kv_splits 4
    t["attn_lse"] = torch.zeros(B, H, 5)


HOSTILE = {
    # name: (mutation, the key the one line must name)
    "splits_2e31": (_splits([2**31 - 1, 1]), "tensor 'num_kv_splits'"),
    "splits_1e8_no_max": (_splits([10**8, 1], drop_max=True), "tensor 'num_kv_splits'"),
    "splits_over_max": (_splits([5, 1]), "tensor 'num_kv_splits'"),
    "heads_0": (_no_heads, "tensor 'q'"),
    "sm_scale_1e308": (_meta("sm_scale", 1e308), "meta key 'sm_scale'"),
    "sm_scale_tiny": (_meta("sm_scale", 1e-300), "meta key 'sm_scale'"),
    "sm_scale_nan": (_meta("sm_scale", math.nan), "meta key 'sm_scale'"),
    "k_scale_inf": (_meta("k_scale", math.inf), "meta key 'k_scale'"),
    "v_scale_zero": (_meta("v_scale", 0.0), "meta key 'v_scale'"),
    "v_scale_huge": (_meta("v_scale", 1e200), "meta key 'v_scale'"),
    "logit_cap_neg": (_meta("logit_cap", -1.0), "meta key 'logit_cap'"),
    "page_1e40": (_meta("page_size", 10**40), "meta key 'page_size'"),
    "page_over_pool": (_meta("page_size", 4096), "meta key 'page_size'"),
    "page_0": (_meta("page_size", 0), "meta key 'page_size'"),
    "max_splits_huge": (_meta("max_kv_splits", 2**40), "meta key 'max_kv_splits'"),
    "rids_short": (_meta("rids", ["a"]), "meta key 'rids'"),
    "rids_long": (_meta("rids", ["a", "b", "c"]), "meta key 'rids'"),
    "step_negative": (_meta("step", -1), "meta key 'step'"),
    "q_fp64": (_q64, "tensor 'q'"),
    "kv_fp64": (_kv64, "tensor 'kv_buffer'"),
    "partials_over_max": (_wide_partials, "tensor 'attn_logits'"),
}


@pytest.fixture(scope="module")
def hostile_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("hostile")
    return {name: write_small(d / f"{name}.safetensors", mut) for name, (mut, _) in HOSTILE.items()}


@pytest.mark.parametrize("name", sorted(HOSTILE))
@pytest.mark.parametrize("command", ["replay", "inspect"])
def test_hostile_capture_is_invalid_with_one_line(hostile_files, name, command):
    path = str(hostile_files[name])
    extra = ["--backend", "reference", "--no-explain"] if command == "replay" else []
    peak0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    code, out, err = run_cli(command, path, *extra)
    assert time.perf_counter() - t0 < 30
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak0 < 512 * 1024  # KiB: no runaway allocation
    lines = error_lines(err)
    assert code == 2, (out, err)
    assert len(lines) == 1 and "Traceback" not in err
    assert path in lines[0] and HOSTILE[name][1] in lines[0], lines[0]


def test_the_clean_small_capture_is_valid_and_agrees(tmp_path):
    path = str(write_small(tmp_path / "good.safetensors"))
    assert run_cli("inspect", path)[0] == 0
    code, out, err = run_cli("replay", path, "--backend", "reference")
    assert code == 0, err


def test_more_splits_than_tokens_is_legal(tmp_path):
    """SGLang's static schedule gives a 7-token request max_kv_splits splits: trailing ones are empty."""
    path = write_small(tmp_path / "c.safetensors", _splits([4, 4]))
    code, out, err = run_cli("replay", str(path), "--backend", "reference")
    assert code == 0, err


def test_split_count_without_max_kv_splits_is_bounded_by_the_ceiling(tmp_path):
    ok = write_small(tmp_path / "ok.safetensors", _splits([MAX_KV_SPLITS, 1], drop_max=True))
    assert read_capture(ok).num_kv_splits[0] == MAX_KV_SPLITS
    bad = write_small(tmp_path / "bad.safetensors", _splits([MAX_KV_SPLITS + 1, 1], drop_max=True))
    with pytest.raises(CaptureError, match="num_kv_splits"):
        read_capture(bad)


def test_a_compacted_pool_may_be_smaller_than_a_page(tmp_path):
    """The hook compacts the pool to the attended rows: page_size is then only checked against its ceiling."""
    from refmla.capture import write_capture

    t, m = small_capture()
    m["page_size"] = 256
    write_capture(tmp_path / "c.safetensors", t, m, compact=True)
    cap = read_capture(tmp_path / "c.safetensors")
    assert cap.kv_buffer.shape[0] < 256 and cap.meta.page_size == 256
    m["page_size"] = MAX_PAGE_SIZE + 1
    with pytest.raises(CaptureError, match="page_size"):
        write_capture(tmp_path / "d.safetensors", t, m, compact=True)


@pytest.mark.parametrize("key", sorted(SCALE_RANGE))
def test_scale_bounds_are_inclusive(tmp_path, key):
    lo, hi = SCALE_RANGE[key]
    for value in (lo, hi):
        read_capture(write_small(tmp_path / f"{key}.safetensors", _meta(key, value)))
    with pytest.raises(CaptureError, match=key):
        read_capture(write_small(tmp_path / f"{key}-out.safetensors", _meta(key, hi * 1.01)))


def test_optional_lists_may_be_absent(tmp_path):
    cap = read_capture(write_small(tmp_path / "c.safetensors", _del_meta("rids")))
    assert cap.meta.rids is None


def test_heads_zero_in_extend_mode_too(tmp_path):
    from refmla.synthetic import preset

    spec = preset("kimi-k2-tp8-extend", seq_lens=(9, 5), num_heads=2)
    path = write_small(tmp_path / "e.safetensors", _no_heads, spec=spec)
    code, out, err = run_cli("inspect", str(path))
    assert code == 2 and "tensor 'q'" in err and len(error_lines(err)) == 1


def test_an_fp32_pool_stays_valid(tmp_path):
    path = write_small(tmp_path / "c.safetensors", set_tensor("kv_buffer", small_capture()[0]["kv_buffer"].float()))
    read_capture(path)
