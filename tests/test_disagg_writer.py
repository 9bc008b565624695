"""``refmla disagg`` with the first link: a prefill KV writer capture beside the prefill pool
captures and the decode captures (written -> transferred -> read). The writer capture is made by
this file's own plain loop (an fp8 writer that forgets its scale, or a correct one); the prefill /
decode pair is the project's clean synthetic pair (refmla.synthetic.disagg)."""

from __future__ import annotations

import json

import pytest
import torch

from refmla.cli import main
from refmla.context import ReplayOptions
from refmla.disagg import run_disagg
from refmla.synthetic.disagg import disagg_preset, synth_disagg


def files(root, side):
    return sorted(str(p) for p in (root / side).glob("*.safetensors"))


def writer_capture(path, rids, layer: int, forget_scale: bool) -> None:
    """One fp8 writer call by a plain loop: rows = (latent, rope) / scale, or without the scale."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(layer)
    T, scale = 4, 0.125
    latent, rope = torch.randn(T, 512, generator=g).bfloat16(), torch.randn(T, 64, generator=g).bfloat16()
    slots = torch.tensor([3, 7, 11, 15])
    keep = torch.arange(2, 17)
    pool = torch.zeros(17, 576, dtype=torch.float8_e4m3fn)
    before = pool[keep].clone()
    for t in range(T):
        row = torch.cat([latent[t].float(), rope[t].float()])
        pool[int(slots[t])] = (row if forget_scale else row / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    meta = {"mode": "kv_write", "writer": "test.plain_loop", "kv_dtype": "float8_e4m3fn", "kv_lora_rank": 512,
            "qk_rope_head_dim": 64, "layer_id": layer, "tp_rank": 0, "rids": rids, "disagg_mode": "prefill"}  # fmt: skip
    t = {"latent": latent, "rope": rope, "slots": slots, "scale": torch.tensor([scale]), "pool_slots": keep,
         "rows_before": before, "rows_after": pool[keep].clone()}  # fmt: skip
    save_file(t, str(path), metadata={"format": "refmla.capture/1", "meta": json.dumps(meta)})


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("writer-disagg")
    synth_disagg(root, disagg_preset("disagg-small"), "none")
    from refmla.disagg.plan import read_header

    first = read_header(files(root, "prefill")[0])
    return root, first.rids, first.layer


@pytest.mark.parametrize("forget_scale", [True, False])
def test_disagg_names_the_writer_when_the_fault_is_in_the_writer(pair, tmp_path, forget_scale):
    root, rids, layer = pair
    w = tmp_path / "writer.safetensors"
    writer_capture(w, rids, layer, forget_scale)
    report = run_disagg(files(root, "prefill") + [str(w)], files(root, "decode"), ReplayOptions(backends=[]))
    mine = [r for r in report.rows if r.layer == layer and r.rid in rids]
    assert mine and all(r.writer is not None for r in mine)
    if not forget_scale:
        assert report.fault == "none" and all(r.writer.status == "ok" for r in mine)
        return
    assert report.fault == "writer" and report.exit_code == 1
    assert all(r.fault == "writer" and "kv_scale_not_applied" in r.sentence for r in mine)
    assert all(r.fault == "none" for r in report.rows if r.layer != layer)  # the other layer's writer was not captured
    assert "fault in the writer" in report.sentence


def test_an_unusable_writer_capture_exits_2_naming_it(pair, tmp_path, capsys):
    root, rids, layer = pair
    w = tmp_path / "writer.safetensors"
    writer_capture(w, rids, layer, False)
    from safetensors.torch import load_file, save_file

    t = load_file(str(w))
    t["scale"] = torch.tensor([float("inf")])
    meta = {"mode": "kv_write", "writer": "x", "kv_dtype": "float8_e4m3fn", "kv_lora_rank": 512, "qk_rope_head_dim": 64}
    save_file(t, str(w), metadata={"format": "refmla.capture/1", "meta": json.dumps(meta)})
    rc = main(["disagg", *files(root, "prefill"), str(w), "--decode", *files(root, "decode"), "--backend", "extend"])
    assert rc == 2 and "tensor 'scale'" in capsys.readouterr().err
