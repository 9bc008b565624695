"""`refmla inspect` of sparse decode captures (refmla.sparse.inspection): the layout and its packing,
each cache's geometry, top-k widths and lengths, the compress ratio, the pool's regions; hostile
input exits 2 with one line naming the file and the key or tensor, as for a dense capture."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from refmla.cli import main
from refmla.region_check import compressed_regions
from refmla.sparse.validation import write_sparse
from refmla.sparse.make import synth_sparse
from refmla.sparse.presets import sparse_preset
from refmla.sparse.synth import build_case

V4, V32 = "deepseek-v4-flash-tp8", "deepseek-v3.2-tp8"


def inspect_json(path, capsys) -> tuple[int, dict]:
    code = main(["inspect", str(path), "--json"])
    return code, json.loads(capsys.readouterr().out)


def entries_read(idx: torch.Tensor, lengths: torch.Tensor) -> int:
    """Entries a kernel reads, counted with a plain loop: not -1 and before the request's length."""
    n = 0
    for b in range(idx.shape[0]):
        for s in range(idx.shape[1]):
            n += sum(1 for k, v in enumerate(idx[b, s].tolist()) if v != -1 and k < int(lengths[b]))
    return n


def _unvalidated(path, case, meta=None, **override):
    from safetensors.torch import save_file

    t = {k: v.contiguous() for k, v in {**case.tensors(), **override}.items() if v is not None}
    save_file(t, str(path), metadata={"format": "refmla.capture/1", "meta": json.dumps(meta or case.meta())})


def test_a_v4_capture_is_described_caches_geometry_topk_ratio_packing(tmp_path, capsys):
    path = tmp_path / "v4.safetensors"
    synth_sparse(path, V4)
    case = build_case(sparse_preset(V4))
    code, d = inspect_json(path, capsys)
    s = d["sparse"]
    assert code == 0 and d["kind"] == "sparse_decode" and d["metadata"]["ok"]
    assert s["layout"] == "v4" and "MODEL1" in s["model_layout"] and s["compress_ratio"] == 4
    assert s["layer_role"] == "compressed" and s["window"] == 128 and s["kv_fp8_dtype"] == "float8_e4m3fn"
    assert s["shape"] == {"B": 4, "S": 1, "H": 8, "D": 512, "Dv": 512} and s["sink"] and s["outputs"] == ["out", "lse"]
    main_c, extra_c = s["caches"]
    # v4: 256 tokens x 584 bytes = 149,504, padded to a multiple of 576: 149,760; C4 pages 64 tokens: 37,440
    assert (main_c["bytes_per_token"], main_c["page_size"], main_c["layout_page_bytes"]) == (584, 256, 149_760)
    assert (extra_c["role"], extra_c["page_size"], extra_c["layout_page_bytes"]) == ("extra", 64, 37_440)
    assert main_c["tokens"] == main_c["pages"] * 256 and main_c["index_width"] == 128 and extra_c["index_width"] == 512
    assert main_c["valid_entries"] == entries_read(case.indices, case.topk_length)
    assert extra_c["valid_entries"] == entries_read(case.extra_indices, case.extra_topk_length)
    assert (main_c["length_min"], main_c["length_max"]) == (int(case.topk_length.min()), int(case.topk_length.max()))
    assert "7 UE8M0" in main_c["packing"] and "448 float8_e4m3fn" in main_c["packing"]


def test_a_v32_capture_is_one_cache_fp32_scales_token_contiguous(tmp_path, capsys):
    path = tmp_path / "v32.safetensors"
    synth_sparse(path, V32)
    code, d = inspect_json(path, capsys)
    s = d["sparse"]
    assert code == 0 and s["layout"] == "v32" and "V3.2" in s["model_layout"] and not s["sink"]
    (c,) = s["caches"]
    assert (c["bytes_per_token"], c["layout_page_bytes"], c["index_width"]) == (656, 64 * 656, 2048)
    assert "4 fp32 scales" in c["packing"] and "token-contiguous" in c["packing"]
    assert main(["inspect", str(path)]) == 0
    text = capsys.readouterr().out
    assert "layout v32" in text and "top-k width 2048" in text and "656 bytes/token" in text


def test_the_pools_regions_are_reported_and_a_finding_exits_1(tmp_path, capsys):
    case = build_case(dataclasses.replace(sparse_preset(V4), seq_lens=(1, 60)))
    regions = compressed_regions(23_448_064, 256, 1024, [0, 4, 128])  # the seed's DSV4-Flash run
    path = tmp_path / "r.safetensors"
    write_sparse(path, case.tensors(), {**case.meta(), **regions, "kv_pool_class": "DeepSeekV4TokenToKVPool",
                                        "mori_max_mr_bytes": 4 << 30})  # fmt: skip
    code, d = inspect_json(path, capsys)
    assert code == 1 and d["region"]["status"] == "finding" and d["region"]["region_bytes"] == 23_448_064 * 256
    assert d["sparse"]["pool_regions"] == regions["kv_pool_region_bytes"]
    assert main(["inspect", str(path)]) == 1
    text = capsys.readouterr().out
    assert "DeepSeekV4TokenToKVPool: 2 registered buffers" in text and "region   FINDING" in text


HOSTILE = {
    "layout": (lambda c: {"meta": {**c.meta(), "kv_layout": "v5"}}, "meta key 'kv_layout'"),
    "ratio": (lambda c: {"meta": {**c.meta(), "compress_ratio": -4}}, "meta key 'compress_ratio'"),
    "past": (lambda c: {"indices": torch.where(c.indices >= 0, c.indices + 10**6, c.indices)}, "tensor 'indices'"),
    "short_pages": (lambda c: {"k_cache": c.main.pages[:, :1000].contiguous()}, "tensor 'k_cache'"),
    "no_layout": (lambda c: {"meta": {k: v for k, v in c.meta().items() if k != "extra_kv_layout"}}, "extra"),
}  # fmt: skip


@pytest.mark.parametrize("bad", HOSTILE)
def test_a_hostile_sparse_capture_exits_2_with_one_line_naming_file_and_key(tmp_path, capsys, bad):
    case = build_case(dataclasses.replace(sparse_preset(V4), seq_lens=(1, 60)))
    make, names = HOSTILE[bad]
    path = tmp_path / f"{bad}.safetensors"
    _unvalidated(path, case, **make(case))
    assert main(["inspect", str(path)]) == 2
    cap = capsys.readouterr()
    err = cap.err.strip().splitlines()
    assert len(err) == 1 and str(path) in err[0] and names in err[0] and "Traceback" not in cap.err, err
    assert "kv_lora_rank" not in err[0]  # the dense reader's complaint is not the sparse capture's problem


def test_a_folder_of_sparse_and_dense_reports_each_one_bad_as_one_line(tmp_path, capsys):
    synth_sparse(tmp_path / "a_v4.safetensors", V4)
    assert main(["synth", str(tmp_path / "b_dense.safetensors")]) == 0
    case = build_case(dataclasses.replace(sparse_preset(V4), seq_lens=(1, 60)))
    _unvalidated(tmp_path / "c_bad.safetensors", case, meta={**case.meta(), "page_size": 0})
    (tmp_path / "d_trunc.safetensors").write_bytes((tmp_path / "a_v4.safetensors").read_bytes()[:5000])
    capsys.readouterr()
    assert main(["inspect", str(tmp_path), "--json"]) == 2
    cap = capsys.readouterr()
    docs = {d["capture"].rsplit("/", 1)[1]: d for d in json.loads(cap.out)}
    assert docs["a_v4.safetensors"]["kind"] == "sparse_decode" and "sparse" not in docs["b_dense.safetensors"]
    assert docs["b_dense.safetensors"]["metadata"]["ok"] and not docs["c_bad.safetensors"]["metadata"]["ok"]
    err = cap.err.strip().splitlines()
    assert len(err) == 2 and "c_bad" in err[0] and "page_size" in err[0] and "d_trunc" in err[1], err
