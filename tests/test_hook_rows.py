"""The hook records what each captured row holds: its token id and how it got into the pool
(refmla.hook.requests -> tensors kv_token_ids / kv_origin).

What runs: SGLang 0.5.23's real Triton MLA backend, pool and ForwardBatch on CPU (tests/sglang_kit.py),
SGLang's real ``Req`` objects with their cache split set by SGLang's own ``split_cached_prefix_by_tier``
(a HiCache request: a device hit, a host hit and an L3 span), and the hook's wrapper on
``ForwardBatch.init_new``. What could not be driven here: the real ``init_new`` needs a live
``ScheduleBatch`` and ``ModelRunner``, so the method is a stand-in with the real signature (asserted
against SGLang's) that hands back a marker; the wrapper must return it untouched.
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
import torch

from refmla.capture import read_capture
from refmla.hook import patching
from refmla.hook.config import HookConfig

FB_MODULE = "sglang.srt.model_executor.forward_batch_info"
RETURNED = object()


def init_new(cls, batch, model_runner, *, capture_hidden_mode=None, return_hidden_states_before_norm,
             extend_position_info=None, spec_mrope_positions=None, kv_loc_plan=None, write_cols=None):  # fmt: skip
    """Stands for ForwardBatch.init_new: hands back a marker."""
    return RETURNED


@pytest.fixture
def sglang(monkeypatch):
    import importlib

    import sglang_kit as T

    try:
        T.kit()
    except (T.Unavailable, ImportError) as e:
        pytest.skip(f"SGLang's Triton backend cannot be built here: {e}")
    mod = importlib.import_module(FB_MODULE)
    real = inspect.signature(mod.ForwardBatch.init_new)
    assert list(real.parameters) == list(inspect.signature(init_new).parameters)[1:]
    monkeypatch.setattr(mod.ForwardBatch, "init_new", classmethod(init_new))
    sched = importlib.import_module("sglang.srt.managers.schedule_batch")
    yield SimpleNamespace(T=T, FB=mod.ForwardBatch, sched=sched)
    patching.uninstall()


def hicache_req(sched, rid: str, prompt: list, output: list, prefix_len: int, host_hit: int, storage_hit: int):
    """A Req whose cached prefix SGLang split by tier (device, host, storage) as its scheduler does."""
    from sglang.srt.sampling.sampling_params import SamplingParams

    req = sched.Req(rid=rid, origin_input_text="", origin_input_ids=list(prompt), sampling_params=SamplingParams())
    req.output_ids.extend(output)
    req.cached_tokens_device, req.cached_tokens_host, req.cached_tokens_storage = sched.split_cached_prefix_by_tier(
        prefix_len=prefix_len, host_hit_len=host_hit, storage_hit_len=storage_hit)  # fmt: skip
    return req


def test_a_decode_capture_carries_each_rows_token_id_and_its_tier(tmp_path, sglang):
    T, FB, sched = sglang.T, sglang.FB, sglang.sched
    fx = T.build(T.Case(mode="decode", prefix_lens=(70, 37)))  # seq_lens 71, 38
    state = patching.install(HookConfig(out_dir=str(tmp_path), min_seq_len=0))
    g = torch.Generator().manual_seed(3)
    p0, p1 = torch.randint(5, 30000, (64,), generator=g).tolist(), torch.randint(5, 30000, (30,), generator=g).tolist()
    # req-0: 48 cached tokens, 32 of them a host hit of which 16 came from the L3 store; req-1: nothing cached
    reqs = [hicache_req(sched, "req-0", p0, [11, 12, 13, 14, 15, 16, 17], 48, 32, 16),
            hicache_req(sched, "req-1", p1, [21, 22, 23, 24, 25, 26, 27, 28], 0, 0, 0)]  # fmt: skip
    batch = SimpleNamespace(reqs=reqs)
    assert FB.init_new(batch, None, return_hidden_states_before_norm=False) is RETURNED  # the server's result, untouched
    fx.forward_batch.rids = ["req-0", "req-1"]
    T.attention_call(fx)
    (path,) = sorted(tmp_path.glob("*.safetensors"))
    cap = read_capture(path)
    assert state.disabled is None and cap.warnings == []
    tok, org = cap.kv_token_ids.tolist(), cap.kv_origin.tolist()
    assert tok[:71] == p0 + [11, 12, 13, 14, 15, 16, 17] and tok[71:] == p1 + [21, 22, 23, 24, 25, 26, 27, 28]
    assert org[:71] == [1] * 16 + [2] * 16 + [3] * 16 + [0] * 23  # device hit, host (L2), L3 store, computed
    assert org[71:] == [0] * 38
    # the request's later tokens are read at capture time (output_ids is appended to in place)
    reqs[0].output_ids.append(18)
    from refmla.hook.requests import TABLE, rows_of

    assert rows_of(TABLE.get("req-0"), 72)[0][-1] == 18


def test_unknown_requests_leave_the_tensors_out_and_a_broken_req_never_reaches_the_server(tmp_path, sglang):
    T, FB = sglang.T, sglang.FB
    fx = T.build(T.Case(mode="decode", prefix_lens=(70, 37)))
    state = patching.install(HookConfig(out_dir=str(tmp_path), min_seq_len=0))

    class Broken:
        rid = "req-0"

        @property
        def origin_input_ids(self):
            raise RuntimeError("a release that moved this")

    assert FB.init_new(SimpleNamespace(reqs=[Broken()]), None, return_hidden_states_before_norm=False) is RETURNED
    assert FB.init_new(SimpleNamespace(), None, return_hidden_states_before_norm=False) is RETURNED  # no reqs at all
    fx.forward_batch.rids = ["x", "y"]
    T.attention_call(fx)
    (path,) = sorted(tmp_path.glob("*.safetensors"))
    cap = read_capture(path)
    assert cap.kv_token_ids is None and cap.kv_origin is None  # nothing known: left out, the capture as before
    assert state.disabled is None and state.files_written == 1


def test_uninstall_restores_init_new(sglang):
    FB = sglang.FB
    before = FB.__dict__["init_new"]
    patching.install(HookConfig(out_dir="/tmp/refmla-unused", min_seq_len=0))
    assert FB.__dict__["init_new"] is not before and FB.init_new.__wrapped__ is init_new
    patching.uninstall()
    assert FB.__dict__["init_new"] is before
