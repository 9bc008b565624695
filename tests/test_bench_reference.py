"""tools/bench_reference.py and its loader of aiter's own torch reference (tools/aiter_peer.py): a
synthetic checkout written here (the loader runs only the functions the entry point reaches, never
the module's imports of aiter or its module-level code), its refusals, the CLI, and aiter's real
op_tests/test_mla.py when a checkout is named by REFMLA_AITER_REPO."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from helpers import ROOT, paged_case
from refmla.attended import Attended
from refmla.reference import mla_decode_ref
from refmla.scales import Scales

_PATH = ROOT / "tools" / "aiter_peer.py"
_spec = importlib.util.spec_from_file_location("aiter_peer", _PATH)
peer_mod = importlib.util.module_from_spec(_spec)
sys.modules["aiter_peer"] = peer_mod  # dataclasses look their module up by name
_spec.loader.exec_module(peer_mod)

# A stand-in for aiter's op_tests/test_mla.py, in its shape: aiter and pandas imported and CUDA made
# the default device at module level (none of which may run here), an entry point that reaches two
# helpers through the module's globals, and a function that needs aiter (which must not be loaded).
SYNTHETIC = textwrap.dedent(
    """
    import pandas as pd
    import torch
    import torch.nn.functional as F

    import aiter
    from aiter import dtypes

    torch.set_default_device("cuda")
    raise SystemExit("the module's own code ran")


    def weights(s):
        return F.softmax(s, dim=-1)


    def attend_one(query, key, value, scale, dtype, is_causal=True):
        s = torch.einsum("qhd,khd->hqk", query.float(), key.float()) * scale  # [H, n, L]
        lse = s.logsumexp(dim=-1)
        out = torch.einsum("hqk,khd->qhd", weights(s), value.float())
        return out.to(dtype), lse


    def torch_mla_extend(q, kvc_cache, qo_indptr, kv_indptr, kv_indices, sm_scale, kv_lora_rank,
                         qk_rope_head_dim, dtype, is_causal=True):
        rows = torch.index_select(kvc_cache, 0, kv_indices)
        outs, lses = [], []
        for b in range(qo_indptr.shape[0] - 1):
            kv = rows[int(kv_indptr[b]) : int(kv_indptr[b + 1])]
            o, lse = attend_one(q[int(qo_indptr[b]) : int(qo_indptr[b + 1])], kv, kv[..., :kv_lora_rank],
                                sm_scale, dtype, is_causal=is_causal)
            outs.append(o)
            lses.append(lse)
        return torch.cat(outs), torch.cat(lses, dim=1).transpose(0, 1)


    def test_mla(ctx_lens):
        return pd.DataFrame(aiter.mla_decode_fwd(dtypes.fp8, ctx_lens))
    """
)


def _repo(tmp_path: Path, text: str = SYNTHETIC) -> Path:
    (tmp_path / "op_tests").mkdir(parents=True, exist_ok=True)
    (tmp_path / "op_tests" / "test_mla.py").write_text(text)
    return tmp_path


def _check_against_the_reference(peer, lens=(5, 300, 1)) -> None:
    """The peer's decode output (bf16) and lse (fp32) against refmla's fp64 reference."""
    q, kv, indptr, idx = paged_case(list(lens), 4, 16, dtype=torch.bfloat16, seed=2)
    out, lse = peer.decode(q, kv, indptr.int(), idx.int(), kv_lora_rank=512, sm_scale=0.1)
    want, want_lse = mla_decode_ref(q, kv, Attended.token_index(indptr, idx), Scales(kv_lora_rank=512, sm_scale=0.1))
    assert out.dtype == torch.bfloat16 and out.shape == want.shape and lse.shape == want_lse.shape
    assert float((out.double() - want).abs().max()) <= 2**-7 * float(want.abs().max())
    assert float((lse.double() - want_lse).abs().max()) <= 1e-4 * float(want_lse.abs().max())


def test_the_loader_runs_only_what_the_entry_point_reaches(tmp_path):
    peer = peer_mod.load_aiter_peer(_repo(tmp_path))
    assert peer.functions == ("weights", "attend_one", "torch_mla_extend")
    assert peer.path == tmp_path / "op_tests" / "test_mla.py" and peer.commit == ""
    assert torch.empty(1).device.type == "cpu", "the module's set_default_device ran"
    assert "aiter" not in sys.modules and "pd" not in peer.fn.__globals__
    _check_against_the_reference(peer)


@pytest.mark.parametrize(
    "text,message",
    [
        (None, "no such file"),
        ("import torch\n\ndef other():\n    return torch\n", "no module-level function torch_mla_extend"),
        ("from aiter import dtypes\n\ndef torch_mla_extend(q):\n    return q.to(dtypes.fp32)\n",
         "needs dtypes, which comes from aiter"),
        ("def torch_mla_extend(q):\n    return helper(q)\n", "torch_mla_extend uses helper, which the file does not"),
        ("def torch_mla_extend(q:\n", "cannot be parsed"),
    ],
)  # fmt: skip
def test_the_loader_refuses_what_it_cannot_load_in_one_line(tmp_path, text, message):
    repo = tmp_path if text is None else _repo(tmp_path, text)
    with pytest.raises(peer_mod.AiterPeerError, match=message) as e:
        peer_mod.load_aiter_peer(repo)
    assert "\n" not in str(e.value) and "test_mla.py" in str(e.value)


def _bench(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "tools" / "bench_reference.py"), *args], capture_output=True,
                          text=True, cwd=ROOT, timeout=600, env={**os.environ, **(env or {})})  # fmt: skip


def test_the_benchmark_refuses_a_bad_checkout_with_exit_2(tmp_path):
    r = _bench("--aiter-repo", str(tmp_path / "nowhere"))
    assert r.returncode == 2 and r.stdout == "", r.stderr[-2000:]
    assert r.stderr.strip().count("\n") == 0 and "nowhere/op_tests/test_mla.py: no such file" in r.stderr


def test_the_benchmark_times_the_peer_it_loads_side_by_side(tmp_path):
    """A small batch end to end with the synthetic checkout given through REFMLA_AITER_REPO: the peer
    is loaded, checked against the reference and timed in the same process as the reference."""
    r = _bench("--requests", "3", "--heads", "4", "--min-len", "200", "--max-len", "600", "--repeat", "1",
               "--threads", "1,2", "--gemm-n", "128", env={peer_mod.ENV: str(_repo(tmp_path))})  # fmt: skip
    assert r.returncode in (0, 1), r.stderr[-2000:]  # 1: a timing target missed on a loaded machine
    assert "executing only weights, attend_one, torch_mla_extend" in r.stdout
    for t in (1, 2):  # both thread counts timed (in one process, interleaved) and judged
        section = r.stdout.split(f"-- {t} thread(s)")[1].split("-- ")[0]
        assert "aiter's output against the reference" in section and "ratio reference / aiter = " in section
        assert " floor " in section and "reference peak +" in section
        line = next(x for x in section.splitlines() if "aiter's output against the reference" in x)
        assert line.endswith(": ok"), line
    assert "-- reference 2 threads vs 1: " in r.stdout
    assert "TARGET MISSED" in r.stdout or "all measured targets met" in r.stdout


@pytest.mark.skipif(not os.environ.get(peer_mod.ENV), reason=f"no aiter checkout: set {peer_mod.ENV}=/path/to/aiter")
def test_aiters_own_reference_loads_and_agrees_with_the_reference():
    peer = peer_mod.load_aiter_peer(os.environ[peer_mod.ENV])
    assert peer.functions[-1] == "torch_mla_extend" and "ref_masked_attention" in peer.functions
    _check_against_the_reference(peer)
