"""vLLM: the vllm_triton backend on every decode golden, and the plugin hook's captures replayed.

vLLM (0.33.0, installed --no-deps: tools/requirements-vllm-nodeps.txt) runs here under the Triton
interpreter; without it these tests skip with the reason.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import vllm_kit
from refmla.backends import get_backend, triton_interp
from refmla.capture import read_capture
from refmla.context import ReplayOptions
from refmla.pipeline import replay_capture

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
DECODE_GOLDENS = sorted(p.name for p in GOLDEN.glob("*.safetensors") if "verify" not in p.name)

ok, why = get_backend("vllm_triton").availability()
pytestmark = pytest.mark.skipif(not ok, reason=f"vllm_triton unavailable: {why}")


@pytest.mark.slow
@pytest.mark.parametrize("name", DECODE_GOLDENS)
def test_every_decode_golden_passes(name):
    report = replay_capture(read_capture(GOLDEN / name), ReplayOptions(backends=["vllm_triton"], explain=False))
    entry = report.backends["vllm_triton"]
    assert entry.status == "pass", entry.reason
    assert report.verdict == "agree"


def test_cli_replay_backend_vllm_triton():
    r = subprocess.run([sys.executable, "-m", "refmla", "replay", str(GOLDEN / "kimi-h8-len1300-splits41of256.safetensors"),
                        "--backend", "vllm_triton", "--json"], capture_output=True, text=True, timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    entry = json.loads(r.stdout)["backends"]["vllm_triton"]
    assert entry["status"] == "pass"
    assert entry["info"]["num_kv_splits"] == 2  # npow2(1300 // 512): vLLM's own rule
    assert entry["info"]["block_table"].startswith("page-1 table")


def _capture(tmp_path, case):
    """Drive vLLM's TritonMLAImpl.forward_mqa with the plugin's hook installed; the written capture."""
    from refmla.hook import vllm_patch
    from refmla.hook.config import HookConfig

    triton_interp.install_bf16_dot_fix()  # the server's own output, computed by the interpreter
    impl, q, cache, md, layer = vllm_kit.build(case)
    vllm_patch.install(HookConfig(out_dir=str(tmp_path), min_seq_len=1))
    try:
        out, _ = impl.forward_mqa(q, cache, md, layer)
        state = vllm_patch.current_state().summary()
    finally:
        vllm_patch.uninstall()
    assert state["disabled"] is None and state["files_written"] == 1, state
    return out, read_capture(next(tmp_path.glob("*.safetensors")))


@pytest.mark.parametrize("q_len", [1, 2])
def test_hook_capture_replays_agree(tmp_path, q_len):
    out, cap = _capture(tmp_path, vllm_kit.VllmCase(q_len=q_len))
    m = cap.meta
    assert (m.engine, m.engine_backend, m.backend, m.split_schedule) == ("vllm", "TRITON_MLA", "vllm_triton", "uniform")
    assert m.page_size == 16 and m.layer_id == 3 and cap.block_table is not None
    assert torch.equal(cap.out.nan_to_num(), out.nan_to_num())  # the server's output, untouched
    if q_len > 1:  # causal multi-token decode: row t of a request sees one more token than row t - 1
        assert cap.query_start_loc.tolist() == [0, 2, 4, 6]
        assert cap.seq_lens.tolist() == [69, 70, 0, 1, 36, 37]
        assert torch.isnan(out[2]).all()  # vLLM's stage 2 writes 0 / 0 for a row with no token
    report = replay_capture(cap, ReplayOptions(backends=["vllm_triton"]))
    statuses = {n: e.status for n, e in report.backends.items()}
    assert statuses == {"reference": "pass", "observed": "pass", "vllm_triton": "pass"}, report.backends
    assert report.verdict == "agree"


def test_hook_leaves_the_server_alone(tmp_path):
    """Same output with and without the hook; a hook failure disables it, never raises."""
    from refmla.hook import vllm_patch
    from refmla.hook.config import HookConfig

    triton_interp.install_bf16_dot_fix()
    impl, q, cache, md, layer = vllm_kit.build(vllm_kit.VllmCase(seq_lens=(5, 9)))
    plain, _ = impl.forward_mqa(q, cache, md, layer)
    vllm_patch.install(HookConfig(out_dir=str(tmp_path), min_seq_len=1))
    try:
        layer.layer_name = object()  # hostile: breaks nothing of vLLM's, only the hook's parsing
        md.decode.block_table = md.decode.block_table.clone()
        hooked, _ = impl.forward_mqa(q, cache, md, layer)
        vllm_patch.current_state().fail(RuntimeError("planted"))
        again, _ = impl.forward_mqa(q, cache, md, layer)
    finally:
        vllm_patch.uninstall()
    assert torch.equal(plain, hooked) and torch.equal(plain, again)


def test_plugin_is_env_gated_and_registered(monkeypatch):
    from refmla.hook import vllm_patch

    monkeypatch.delenv("REFMLA_CAPTURE_DIR", raising=False)
    vllm_patch.plugin()
    assert vllm_patch.current_state() is None  # nothing installed without REFMLA_CAPTURE_DIR
    monkeypatch.setenv("REFMLA_CAPTURE_DIR", "/tmp/refmla-never")
    monkeypatch.setenv("REFMLA_CAPTURE_EVERY", "zero")  # unparsable: logged, vLLM unaffected
    vllm_patch.plugin()
    assert vllm_patch.current_state() is None
    text = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    assert '[project.entry-points."vllm.general_plugins"]' in text
    assert 'refmla_capture = "refmla.hook.vllm_patch:plugin"' in text
