"""SGLang's real Triton MLA backend and KV pool on a CPU, for the hook's tests and tools/capture_e2e.py.

What is real and what is not (SGLang 0.5.23, CPU only, Triton interpreter):

* real: ``TritonAttnBackend`` (built by SGLang's own ``ATTENTION_BACKENDS["triton"]``),
  ``MLATokenToKVPool``, ``ReqToTokenPool``, ``ForwardBatch``, ``RadixAttention`` and the call
  path ``RadixAttention -> backend.forward -> forward_decode / forward_extend ->
  decode_attention_fwd / extend_attention_fwd``, all on CPU tensors with the kernels run by the
  Triton interpreter;
* stand-in: the model runner. SGLang's ``ModelRunner`` loads a model and sets up devices and
  process groups, so SGLang's own attention unit-test kit
  (``sglang.test.kits.attention_unittest.attention_methods.mla_attention``) provides
  ``MockMLAModelRunner``, a ``ModelRunner`` subclass that builds the pools and nothing else,
  and a one-layer absorbed-MLA module that writes the latent KV and calls ``RadixAttention``.
  That kit is used as it is (imported, not copied).

Three things the CPU needs first, done by :func:`prepare`:

1. ``TRITON_INTERPRET=1`` before SGLang's kernel modules are imported (refmla's
   ``ensure_interpreter``), and for bf16 refmla's fix of the interpreter's ``tl.dot``;
2. :func:`refmla.backends.cpu_compat.torchvision_cpu_shim`: PyPI's torchvision is a CUDA build
   that cannot import next to a CPU torch, and SGLang imports it;
3. the parallel ranks that a launched server publishes (``tp_rank``, ``attn_dcp_rank``, ...),
   stated with ``get_parallel().override_permanently``.
"""

from __future__ import annotations

import importlib
import warnings
from dataclasses import dataclass
from typing import Any, Optional

from refmla.backends.cpu_compat import torchvision_cpu_shim
from refmla.hook.sglang_paths import CAPTURE_MODE_PROBES

KIT = "sglang.test.kits.attention_unittest.attention_methods.mla_attention"
VERIFY_KIT = "sglang.test.kits.attention_unittest.runner_modes.speculative_target_verify_runner"


class Unavailable(RuntimeError):
    """SGLang's backend cannot be built here; the message says what is missing."""


def prepare(tp_rank: int = 0) -> None:
    """Interpreter, torchvision schemas, parallel ranks. Call before importing SGLang's backend."""
    from refmla.backends.triton_interp import ensure_interpreter

    interpreting, note = ensure_interpreter()
    if not interpreting and "GPU" not in note:
        raise Unavailable(note)
    torchvision_cpu_shim()
    warnings.filterwarnings("ignore", message="Only CUDA")
    try:
        from sglang.srt.runtime_context import get_parallel
    except Exception as e:
        raise Unavailable(f"sglang.srt.runtime_context not importable: {type(e).__name__}: {e}") from e
    get_parallel().override_permanently(attn_dcp_rank=0, attn_dcp_size=1, attn_tp_rank=tp_rank, tp_rank=tp_rank)


def kit():
    """SGLang's MLA attention test kit, or Unavailable with the reason."""
    prepare()  # idempotent; also when something else imported sglang first
    try:
        return importlib.import_module(KIT)
    except Exception as e:
        raise Unavailable(f"{KIT} not importable: {type(e).__name__}: {e}") from e


@dataclass
class Case:
    mode: str = "decode"  # decode | extend | verify (target_verify: extend_lens = draft_token_num each) | draft_extend
    topk: int = 1  # verify: 1 a chain; 2 the kit's tree (draft_token_num 3 only)
    num_heads: int = 16  # DeepSeek-V3 at TP8 has 16 query heads per rank
    prefix_lens: tuple = (70, 37)  # tokens already cached per request
    extend_lens: tuple = ()  # extend: new tokens per request
    page_size: int = 1
    kv_lora_rank: int = 512
    qk_rope_head_dim: int = 64
    max_context_len: int = 160
    dtype: str = "bfloat16"
    name: str = "refmla_hook"  # the kit seeds from the name


class _Skipper:
    """The kit reports an unavailable backend through a unittest-style skipTest."""

    def skipTest(self, reason):  # noqa: N802 - the kit's name
        raise Unavailable(reason)


def build(case: Case) -> Any:
    """A kit fixture: ``.backend`` (TritonAttnBackend), ``.runner`` (pools), ``.forward_batch``."""
    import torch

    K = kit()
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    dtype = getattr(torch, case.dtype)
    if dtype == torch.bfloat16:
        from refmla.backends.triton_interp import install_bf16_dot_fix, interpreter_active

        if interpreter_active():
            ok, note = install_bf16_dot_fix()
            if not ok:
                raise Unavailable(note)
    modes = {"decode": ForwardMode.DECODE, "extend": ForwardMode.EXTEND, "verify": ForwardMode.TARGET_VERIFY,
             "draft_extend": getattr(ForwardMode, "DRAFT_EXTEND_V2", None)}  # fmt: skip
    if modes[case.mode] is None:
        raise Unavailable(f"this SGLang has no ForwardMode for {case.mode}")
    kcase = K.MLAAttentionCase(
        name=case.name, backend="triton", forward_mode=modes[case.mode], num_heads=case.num_heads,
        page_size=case.page_size, prefix_lens=tuple(case.prefix_lens), extend_lens=tuple(case.extend_lens),
    )  # fmt: skip
    fixture = K.build_mla_attention_fixture(
        _Skipper(), kcase, kv_lora_rank=case.kv_lora_rank, qk_rope_head_dim=case.qk_rope_head_dim,
        hidden_size=64, max_context_len=case.max_context_len, dtype=dtype, device="cpu",
    )  # fmt: skip
    if case.mode == "verify":
        make_verify_batch(fixture, kcase, case.topk)
    elif case.mode == "draft_extend":
        make_draft_extend_batch(fixture, kcase)
    return fixture


def make_draft_extend_batch(fixture, kcase) -> None:
    """A DRAFT_EXTEND_V2 batch as production has it before init_forward_metadata: seq_lens = prefix +
    accepted tokens, spec_info an EagleDraftExtendInput. (The kit's draft-extend runner does the
    same but imports SGLang's scheduler, which needs setproctitle; this builds the two fields.)"""
    import torch

    try:
        from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
        from sglang.srt.speculative.eagle_info import EagleDraftExtendInput
    except Exception as e:
        raise Unavailable(f"EagleDraftExtendInput not importable: {type(e).__name__}: {e}") from e
    fb, lens = fixture.forward_batch, list(kcase.input_lens)
    seq = [p + n for p, n in zip(kcase.prefix_lens, lens)]
    fb.seq_lens = torch.tensor(seq, dtype=torch.int32)
    fb.seq_lens_cpu, fb.seq_lens_sum = fb.seq_lens.clone(), sum(seq)
    accept = torch.tensor(lens, dtype=torch.int32)
    spec = EagleDraftExtendInput(
        hidden_states=None, num_correct_drafts=accept - 1, num_accept_tokens=accept, num_accept_tokens_cpu=lens,
        input_ids=fb.input_ids, seq_lens=fb.seq_lens, seq_lens_cpu=fb.seq_lens_cpu,
        req_pool_indices=fb.req_pool_indices, positions=fb.positions, capture_hidden_mode=CaptureHiddenMode.LAST,
        num_tokens_per_req=max(lens), num_tokens_for_logprob_per_req=1,
    )  # fmt: skip
    spec.extend_seq_lens_tensor, spec.extend_seq_lens_cpu = accept.clone(), lens
    fb.spec_info = spec


def make_verify_batch(fixture, kcase, topk: int) -> None:
    """The kit's target_verify batch: seq_lens = the prefixes, spec_info an EagleVerifyInput with
    SGLang's custom_mask (the kit's own helpers, imported)."""
    try:
        V = importlib.import_module(VERIFY_KIT)
    except Exception as e:
        raise Unavailable(f"{VERIFY_KIT} not importable: {type(e).__name__}: {e}") from e
    fb = fixture.forward_batch
    V._prepare_target_verify_batch(fb, kcase, "cpu")
    fb.spec_info = V._make_spec_verify_input(kcase, fb, topk=topk, device="cpu", spec_kind="eagle")


def run(fixture) -> Any:
    """One eager forward of the kit's MLA layer: init_forward_metadata, then RadixAttention."""
    return kit().run_mla_fixture_eager(fixture)


def attention_call(fixture) -> Any:
    """Run only the attention call (init_forward_metadata + RadixAttention), return its output.

    Like :func:`run` but returns the attention output [T, H * Dv] instead of the layer's
    projected output, so that a test can compare it with a capture's ``out``.
    """
    import torch
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

    m, fb = fixture.actual_module, fixture.forward_batch
    with torch.no_grad(), forward_context(ForwardContext(attn_backend=fixture.backend)):
        fixture.backend.init_forward_metadata(fb)
        q_nope, k_nope, q_rope, k_rope = m.forward_absorb_prepare(fixture.input_hidden)
        m.write_kv_cache(fb.out_cache_loc, k_nope, k_rope)
        q = torch.cat([q_nope, q_rope], dim=-1) if m.qk_rope_head_dim else q_nope
        return m.attn_mqa(q.flatten(1, 2), None, None, fb, save_kv_cache=False)


def mla_pool(dtype: str = "bfloat16", size: int = 64, kv_lora_rank: int = 512, qk_rope_head_dim: int = 64) -> Any:
    """SGLang's real ``MLATokenToKVPool`` on the CPU (one layer; fp8 stored as uint8 as SGLang does)."""
    import torch

    prepare()
    try:
        from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool
        from sglang.srt.runtime_context import get_parallel

        get_parallel().override_permanently(dcp_enabled=False)  # set_kv_buffer asks (a server publishes it)
    except Exception as e:
        raise Unavailable(f"MLATokenToKVPool not importable: {type(e).__name__}: {e}") from e
    return MLATokenToKVPool(size=size, page_size=1, dtype=getattr(torch, dtype), kv_lora_rank=kv_lora_rank,
                            qk_rope_head_dim=qk_rope_head_dim, layer_num=1, device="cpu", enable_memory_saver=False)  # fmt: skip


def capture_mode_flag() -> Optional[tuple[Any, str]]:
    """(module, attribute) of SGLang's 'a graph is being captured' flag, for simulating capture."""
    for module, _getter in CAPTURE_MODE_PROBES:
        try:
            mod = importlib.import_module(module)
        except Exception:
            continue
        if hasattr(mod, "is_capture_mode"):
            return mod, "is_capture_mode"
    return None
