"""DeepSeek-V4-Flash's per-layer compress ratios (config.compress_ratios[layer_id], as SGLang's
DeepseekV4Attention reads them): the presets of each kind of layer, `synth --layer N`, the meta
that carries the layer's ratio and the model's list, and the validation that holds them together."""

from __future__ import annotations

import dataclasses
import json

import pytest

from refmla.cli import main
from refmla.sparse.validation import read_sparse
from refmla.sparse.presets import PRESETS, V4_FLASH_COMPRESS_RATIOS, for_layer, sparse_preset
from refmla.options import ReplayOptions
from refmla.pipeline import replay_file
from refmla.sparse.synth import build_case

V4 = "deepseek-v4-flash-tp8"


def test_v4_flash_list_is_two_window_layers_then_c4_c128_alternating_and_the_mtp_layer():
    r = V4_FLASH_COMPRESS_RATIOS
    assert len(r) == 43 + 1 and r[:4] == (0, 0, 4, 128) and r[42] == 4 and r[43] == 0
    assert all(r[i] == (4 if i % 2 == 0 else 128) for i in range(2, 43))


@pytest.mark.parametrize("name,layer", [(V4, 2), ("deepseek-v4-flash-tp8-c128", 3), ("deepseek-v4-flash-tp8-swa", 0)])
def test_each_v4_preset_is_one_layer_of_its_kind(name, layer):
    assert dataclasses.replace(for_layer(sparse_preset(V4), layer), layer_id=None, name=name) == PRESETS[name]


@pytest.mark.parametrize("layer,ratio,extra_page", [(0, 0, None), (1, 0, None), (2, 4, 64), (41, 128, 2), (43, 0, None)])
def test_synth_of_a_layer_carries_that_layers_ratio_and_replays_with_it(tmp_path, capsys, layer, ratio, extra_page):
    path = tmp_path / f"l{layer}.safetensors"
    assert main(["synth", str(path), "--preset", V4, "--layer", str(layer)]) == 0
    cap = read_sparse(path)
    m = cap.meta
    assert (m.layer_id, m.compress_ratio, m.extra_page_size) == (layer, ratio, extra_page)
    assert m.layer_role == ("compressed" if ratio else "window") and m.compress_ratios == list(V4_FLASH_COMPRESS_RATIOS)
    assert (cap.extra_k_cache is None) == (ratio == 0)
    if ratio == 128:  # every compressed token of the longest request (2100 // 128 = 16), padded to 64
        assert cap.extra_indices.shape[2] == 64 and int(cap.extra_topk_length.max()) == 2100 // 128
    capsys.readouterr()
    assert main(["replay", str(path), "--backend", "reference", "--backend", "observed", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["meta"]["compress_ratio"] == ratio and r["meta"]["layer_id"] == layer


def test_a_named_layer_outside_the_model_or_of_a_one_cache_model_is_refused(tmp_path, capsys):
    assert main(["synth", str(tmp_path / "x.safetensors"), "--preset", V4, "--layer", "44"]) == 2
    assert "layer 44 is outside" in capsys.readouterr().err
    assert main(["synth", str(tmp_path / "y.safetensors"), "--preset", "deepseek-v3.2-tp8", "--layer", "1"]) == 2
    assert main(["synth", str(tmp_path / "z.safetensors"), "--layer", "1"]) == 2  # a dense preset
    assert not list(tmp_path.iterdir())


def _write(path, case, meta, **override):
    from safetensors.torch import save_file

    t = {k: v.contiguous() for k, v in {**case.tensors(), **override}.items() if v is not None}
    save_file(t, str(path), metadata={"format": "refmla.capture/1", "meta": json.dumps(meta)})


C128 = dataclasses.replace(for_layer(sparse_preset(V4), 3), seq_lens=(1, 60, 300))
RATIOS = list(V4_FLASH_COMPRESS_RATIOS)
BAD = {
    "disagrees": ({"compress_ratio": 4}, "meta key 'compress_ratio'", "compress_ratios[3] is 128"),
    "past_the_list": ({"layer_id": 44}, "meta key 'layer_id'", "outside compress_ratios"),
    "not_a_ratio": ({"compress_ratios": RATIOS[:5] + [8] + RATIOS[6:]}, "meta key 'compress_ratios'", "got 8"),
    "compressed_without_its_cache": ({"compress_ratios": None, "compress_ratio": 128, "extra_kv_layout": None,
                                      "extra_page_size": None}, "tensor 'extra_k_cache'", "is a compressed layer"),
}  # fmt: skip


@pytest.mark.parametrize("bad", BAD)
def test_meta_that_contradicts_the_layer_exits_2_with_one_line(tmp_path, capsys, bad):
    case = build_case(C128)
    change, key, why = BAD[bad]
    meta = {k: v for k, v in {**case.meta(), **change}.items() if v is not None}
    drop = {"extra_k_cache": None, "extra_indices": None, "extra_topk_length": None} if "cache" in bad else {}
    path = tmp_path / f"{bad}.safetensors"
    _write(path, case, meta, **drop)
    assert main(["replay", str(path), "--backend", "reference"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(path) in err[0] and key in err[0] and why in err[0], err


def test_the_ratio_comes_from_the_list_when_meta_names_only_the_layer(tmp_path):
    case = build_case(C128)
    meta = {k: v for k, v in case.meta().items() if k not in ("compress_ratio", "layer_role")}
    path = tmp_path / "list.safetensors"
    _write(path, case, meta)
    cap = read_sparse(path)
    assert cap.meta.compress_ratio == 128 and cap.meta.layer_role == "compressed"
    assert replay_file(str(path), ReplayOptions(backends=["reference", "observed"])).verdict == "agree"


def test_a_window_only_layer_with_a_compressed_cache_is_refused(tmp_path, capsys):
    case = build_case(C128)
    path = tmp_path / "w.safetensors"
    _write(path, case, {**case.meta(), "layer_id": 0, "compress_ratio": 0, "layer_role": "window"})
    assert main(["inspect", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "tensor 'extra_k_cache'" in err[0] and "window-only layer" in err[0], err
