"""The ``triton`` backend: SGLang's real Triton MLA decode kernel against the fp64 reference.

On a CPU-only machine the kernel runs in the Triton interpreter with refmla's bf16 fix
(refmla/backends/triton_interp.py); on a GPU it is compiled. Skipped only when sglang or triton
is not installed (``make test`` installs both, see tools/requirements-sglang-*.txt).
"""

from __future__ import annotations

import importlib.util
import inspect
import math
import zlib

import pytest
import torch

from refmla.backends import triton_interp

# Before anything imports triton: its helpers are decorated for the interpreter at first import.
INTERPRETING, HOW = triton_interp.ensure_interpreter()

_missing = [m for m in ("triton", "sglang") if importlib.util.find_spec(m) is None]
if _missing:
    pytest.skip(f"{' and '.join(_missing)} not installed (make test installs them)", allow_module_level=True)
if not INTERPRETING and not triton_interp.gpu_present():
    pytest.skip(HOW, allow_module_level=True)

from refmla import reference as ref  # noqa: E402
from refmla.attended import Attended  # noqa: E402
from refmla.backends import BackendUnavailable  # noqa: E402
from refmla.backends import triton as tb  # noqa: E402
from refmla import schedule  # noqa: E402
from refmla.capture import read_capture, write_capture  # noqa: E402
from refmla.backends.base import BackendResult  # noqa: E402
from refmla.capture import Capture, parse_meta  # noqa: E402
from refmla.context import ReplayContext, ReplayOptions  # noqa: E402
from refmla.pipeline import compare_splits  # noqa: E402
from refmla.synthetic import DEEPSEEK_V3_SCALE, KIMI_K2_SCALE, SynthSpec, make_inputs, make_meta  # noqa: E402

DEVICE = "cpu" if INTERPRETING else "cuda"
# the interpreter evaluates masked-off lanes too (-inf - -inf); the kernel masks the results
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
needs_interpreter = pytest.mark.skipif(not INTERPRETING, reason="checks the Triton interpreter itself")

# Real shapes: the per-rank heads of Kimi-K2 (64 / TP8) and DeepSeek-V3 (128 / TP8).
MODELS = {
    "kimi-k2-tp8": dict(num_heads=8, sm_scale=KIMI_K2_SCALE),
    "deepseek-v3-tp8": dict(num_heads=16, sm_scale=DEEPSEEK_V3_SCALE),
}
SEQ_LENS = (270, 97, 1, 45)  # modest: the interpreter walks every program in Python
# split schedules: one split; four; 16 splits, more than L/32, so each request's last splits are empty
SCHEDULES = {"n1": 1, "n4": 4, "trailing-empty": 16}


def make_case(model: str, dtype: torch.dtype, page_size: int, schedule: str, logit_cap: float, **kw) -> SynthSpec:
    """A synthetic decode call: shuffled pages, NaN in every row no request attends."""
    seq_lens = kw.pop("seq_lens", SEQ_LENS)
    return SynthSpec(
        name=model, dtype=dtype, page_size=page_size, seq_lens=seq_lens,
        num_kv_splits=(SCHEDULES[schedule],) * len(seq_lens), max_kv_splits=kw.pop("max_kv_splits", 16),
        logit_cap=logit_cap, free_pages=2, seed=kw.pop("seed", 0), **MODELS[model], **kw,
    )  # fmt: skip


def run_kernel(spec: SynthSpec, t: dict, **kw):
    launch = tb.TritonLaunch(page_size=spec.page_size, max_kv_splits=kw.pop("max_kv_splits", spec.max_kv_splits), **kw)
    return tb.run_triton_decode(
        t["q"].to(DEVICE), t["kv_buffer"].to(DEVICE), t["kv_indptr"], t["kv_indices"], t["num_kv_splits"],
        spec.scales(), launch,
    )  # fmt: skip


def replay_context(spec: SynthSpec, t: dict) -> ReplayContext:
    """The replay's own context (reference, split-aware control, comparator) for in-memory inputs."""
    cap = Capture(path=f"<{spec.name}>", meta=parse_meta(make_meta(spec)), **t)
    return ReplayContext(cap, ReplayOptions())


def check_output(spec: SynthSpec, t: dict, out: torch.Tensor):
    """The kernel's output against the fp64 reference under the contract's tolerance."""
    nonempty = t["seq_lens"] > 0  # the kernel leaves zero-length rows NaN (0 / 0)
    return replay_context(spec, t).compare("triton", out.cpu(), row_mask=nonempty)


def check_splits(spec: SynthSpec, t: dict, attn_logits: torch.Tensor, attn_lse: torch.Tensor) -> dict:
    """Every non-empty split's partial and lse against the split reference (replay's check)."""
    S = attn_logits.shape[2]
    _, _, valid = ref.mla_decode_split_ref(t["q"], t["kv_buffer"], Attended.from_tensors(t), t["num_kv_splits"],
                                           spec.scales(), max_kv_splits=S)  # fmt: skip
    logits = attn_logits.cpu()
    assert torch.isnan(logits[~valid[:, None, :].expand(-1, logits.shape[1], -1)]).all(), "empty split written"
    res = BackendResult(out=attn_logits[:, :, 0], attn_logits=attn_logits.cpu(), attn_lse=attn_lse.cpu(),
                        num_kv_splits=t["num_kv_splits"])  # fmt: skip
    return compare_splits(replay_context(spec, t), res).to_json()


# --------------------------------------------------------------------------------------------
# The kernel against the reference
# --------------------------------------------------------------------------------------------


def check_case(spec: SynthSpec) -> None:
    t = make_inputs(spec)
    if spec.logit_cap:  # logits of std ~3 would barely bend under a cap of 30: make it bite
        t["q"] = (t["q"].float() * 8).to(spec.dtype)
    out, attn_logits, attn_lse, info = run_kernel(spec, t)

    cmp = check_output(spec, t, out)
    assert cmp.passed, cmp.summary()
    splits = check_splits(spec, t, attn_logits, attn_lse)
    assert splits["status"] == "pass" and splits["compared_splits"] > 0, splits
    assert info["splits_used"] == int(schedule.nonempty_splits_batch(t["seq_lens"], t["num_kv_splits"]).max())


@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("page_size", [1, 256], ids=["page1", "page256"])
@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_kernel_matches_reference(dtype, model, page_size, schedule):
    seed = zlib.crc32(f"{model}/{page_size}/{schedule}".encode()) % 1000
    check_case(make_case(model, dtype, page_size, schedule, 0.0, seed=seed))


@pytest.mark.parametrize("schedule", ["n1", "trailing-empty"])
@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_kernel_matches_reference_with_logit_cap(dtype, model, schedule):
    check_case(make_case(model, dtype, 256, schedule, 30.0, seed=11))


def test_zero_length_request_is_nan_and_others_exact():
    spec = make_case("kimi-k2-tp8", torch.bfloat16, 16, "n4", 0.0, seq_lens=(37, 0, 65))
    t = make_inputs(spec)
    out, _, _, _ = run_kernel(spec, t)
    assert torch.isnan(out[1]).all(), "SGLang's stage 2 computes 0 / 0 for a request with no tokens"
    cmp = check_output(spec, t, out)
    assert cmp.passed, cmp.summary()


# --------------------------------------------------------------------------------------------
# Trimming the split buffers is exact
# --------------------------------------------------------------------------------------------


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.cpu().contiguous().view(torch.int16 if x.element_size() == 2 else torch.int32)


@pytest.mark.parametrize("schedule", ["n4", "trailing-empty"])
def test_trimmed_equals_production_sized_bit_for_bit(schedule):
    spec = make_case("deepseek-v3-tp8", torch.bfloat16, 1, schedule, 0.0, seq_lens=(270, 1, 45), max_kv_splits=64)
    t = make_inputs(spec)
    out_t, logits_t, lse_t, info_t = run_kernel(spec, t, trim=True)
    out_p, logits_p, lse_p, info_p = run_kernel(spec, t, trim=False)
    S = info_t["splits_used"]
    assert info_t["trimmed"] and S < 64 and info_p["splits_used"] == 64
    assert torch.equal(_bits(out_t), _bits(out_p))
    assert torch.equal(_bits(logits_t), _bits(logits_p[:, :, :S]))  # NaN (untouched) in the same places
    assert torch.equal(_bits(lse_t), _bits(lse_p[:, :, :S]))
    assert torch.isnan(logits_p[:, :, S:]).all() and torch.isnan(lse_p[:, :, S:]).all()


# --------------------------------------------------------------------------------------------
# The interpreter's bf16 fix
# --------------------------------------------------------------------------------------------


@needs_interpreter
def test_bf16_fails_without_the_interpreter_fix_and_passes_with_it():
    spec = make_case("kimi-k2-tp8", torch.bfloat16, 1, "n4", 0.0, seq_lens=(100, 40))
    t = make_inputs(spec)
    with triton_interp.bf16_dot_fix(enabled=False):
        broken, _, _, _ = run_kernel(spec, t)
    assert not check_output(spec, t, broken).passed  # raw uint16 products: garbage
    with triton_interp.bf16_dot_fix(enabled=False, parts=["cast_impl"]):
        truncated, _, _, _ = run_kernel(spec, t)
    cmp = check_output(spec, t, truncated)  # right dot, truncating fp32 -> bf16: biased low
    assert not cmp.passed and cmp.worst_row_cos_diff > 1e-5, cmp.summary()
    fixed, _, _, info = run_kernel(spec, t)
    assert info["bf16_dot_fix"]
    cmp = check_output(spec, t, fixed)
    assert cmp.passed, cmp.summary()


@needs_interpreter
def test_fix_parts_on_a_tiny_kernel():
    """Each patched interpreter method against torch, broken without the fix, exact with it."""
    import triton
    import triton.language as tl

    @triton.jit
    def dot_and_casts(A, B, C, C16, C8, N: tl.constexpr):
        r = tl.arange(0, N)
        a = tl.load(A + r[:, None] * N + r[None, :])
        b = tl.load(B + r[:, None] * N + r[None, :])
        c = tl.dot(a, b)  # bf16 x bf16 -> fp32
        tl.store(C + r[:, None] * N + r[None, :], c)
        tl.store(C16 + r[:, None] * N + r[None, :], c)  # fp32 -> bf16 on store
        tl.store(C8 + r[:, None] * N + r[None, :], (c / 16).to(C8.dtype.element_ty))  # fp32 -> fp8

    g = torch.Generator().manual_seed(3)
    a, b = (torch.randn(16, 16, generator=g).to(torch.bfloat16) for _ in range(2))
    c, c16 = torch.empty(16, 16), torch.empty(16, 16, dtype=torch.bfloat16)
    c8 = torch.empty(16, 16, dtype=torch.float8_e4m3fn)
    exact = a.double() @ b.double()

    def launch():
        dot_and_casts[(1,)](a, b, c, c16, c8, N=16)

    with triton_interp.bf16_dot_fix(enabled=False, parts=["create_dot"]):
        launch()
    assert (c.double() - exact).abs().max() > 1e3  # the interpreter's own dot: uint16 products
    with triton_interp.bf16_dot_fix(enabled=False, parts=["cast_impl", "create_fp_to_fp"]):
        launch()
    assert (c.double() - exact).abs().max() < 1e-5
    assert not torch.equal(_bits(c16), _bits(c.to(torch.bfloat16)))  # truncated, not rounded
    assert not torch.equal(c8.view(torch.uint8), (c / 16).to(torch.float8_e4m3fn).view(torch.uint8))
    with triton_interp.bf16_dot_fix():
        launch()
    assert torch.equal(_bits(c16), _bits(c.to(torch.bfloat16)))  # torch rounds to nearest even
    assert torch.equal(c8.view(torch.uint8), (c / 16).to(torch.float8_e4m3fn).view(torch.uint8))

    ties = torch.tensor([1.0 + 2**-8, 1.0 + 3 * 2**-8, -(1.0 + 2**-8), 3e38, 3.4e38, float("inf"), 1e-40])
    ours = torch.from_numpy(triton_interp.f32_to_bf16_bits(ties.numpy()).view("int16"))
    assert torch.equal(ours, _bits(ties.to(torch.bfloat16)))
    nan = torch.from_numpy(triton_interp.f32_to_bf16_bits(torch.tensor([math.nan]).numpy()).view("int16"))
    assert torch.isnan(nan.view(torch.bfloat16)).all()


def test_fp8_kv_cache_matches_reference():
    """An fp8 (OCP e4m3, MI355X) latent cache with k_scale / v_scale, bf16 q and output."""
    fn, _, version = tb.locate_decode_kernel()
    if "k_scale" not in inspect.signature(fn).parameters:
        pytest.skip(f"sglang {version}'s decode_attention_fwd takes no k_scale / v_scale")
    spec = make_case("kimi-k2-tp8", torch.bfloat16, 1, "n4", 0.0, seq_lens=(200, 65, 1),
                     kv_dtype=torch.float8_e4m3fn, k_scale=0.5, v_scale=0.25)  # fmt: skip
    check_case(spec)


@needs_interpreter
def test_fix_is_idempotent_and_reported():
    assert triton_interp.install_bf16_dot_fix()[0]
    assert triton_interp.install_bf16_dot_fix()[0]
    assert triton_interp.bf16_dot_fix_installed()
    ok, how = tb.TritonBackend().availability()
    assert ok and "bf16 dot fix applied" in how and "sglang" in how, how


# --------------------------------------------------------------------------------------------
# The split schedule SGLang computes when the capture has none
# --------------------------------------------------------------------------------------------


def test_default_num_kv_splits_kimi_k2_step():
    """8 requests x 1300 tokens, 8 heads, max_kv_splits 256 on MI355X: 130 splits, 41 with tokens."""
    lens = torch.full((8,), 1300)
    n = schedule.default_num_kv_splits(lens, max_kv_splits=256, num_heads=8, cu_count=256)
    assert n.tolist() == [130] * 8
    assert schedule.nonempty_splits_batch(lens, n).tolist() == [41] * 8
    assert schedule.mla_max_kv_splits(256, 131072) == 256


@needs_interpreter
@pytest.mark.parametrize("seed", range(4))
def test_default_num_kv_splits_matches_sglang_kernel(seed):
    """Our formula against SGLang's own get_num_kv_splits_triton, run in the interpreter."""
    try:
        from sglang.kernels.ops.attention.metadata import get_num_kv_splits_triton
    except ImportError:
        pytest.skip("this SGLang has no sglang.kernels.ops.attention.metadata")
    g = torch.Generator().manual_seed(seed)
    for _ in range(6):
        B = int(torch.randint(1, 40, (1,), generator=g))
        lo = int(torch.randint(1, 3000, (1,), generator=g))
        lens = torch.randint(lo, lo + int(torch.randint(1, 70000, (1,), generator=g)), (B,), generator=g)
        H = int([8, 16, 128][int(torch.randint(0, 3, (1,), generator=g))])
        max_splits, cus = int([16, 64, 256][seed % 3]), int([256, 304, 132, 80][seed])
        expected = torch.empty(B, dtype=torch.int32)
        get_num_kv_splits_triton[(1,)](
            expected, lens.to(torch.int32), B, 1, H, 1, max_splits, cus, MAX_NUM_SEQ=256
        )  # fmt: skip
        ours = schedule.default_num_kv_splits(lens, max_kv_splits=max_splits, num_heads=H, cu_count=cus)
        assert ours.tolist() == expected.tolist(), (lens.tolist(), H, max_splits, cus)


# --------------------------------------------------------------------------------------------
# Calling the kernel by its signature, across SGLang releases
# --------------------------------------------------------------------------------------------


def test_kernel_is_located_and_called_by_keyword():
    fn, module_path, version = tb.locate_decode_kernel()
    assert module_path in triton_interp.KERNEL_MODULES and fn.__name__ == "decode_attention_fwd"
    assert version and version != "unknown"

    def old(q, k_buffer, v_buffer, o, kv_indptr, kv_indices, attn_logits, attn_lse, num_kv_splits,
            max_kv_splits, sm_scale, logit_cap=0.0, sinks=None):  # fmt: skip
        """0.5.6's signature: no k_scale / v_scale, has_mla, page_size."""

    values = {name: name for name in tb._KNOWN} | dict(k_scale=1.0, v_scale=1.0, page_size=256, has_mla=True)
    kwargs, notes = tb.build_kernel_kwargs(old, values)
    assert set(kwargs) == {"q", "k_buffer", "v_buffer", "o", "kv_indptr", "kv_indices", "attn_logits",
                           "attn_lse", "num_kv_splits", "max_kv_splits", "sm_scale", "logit_cap"}  # fmt: skip
    assert any("page_size" in n for n in notes) and any("has_mla" in n for n in notes)
    with pytest.raises(tb.KernelSignatureError, match="k_scale"):
        tb.build_kernel_kwargs(old, values | {"k_scale": 0.5})

    def future(q, k_buffer, new_required_thing, **kw):
        pass

    with pytest.raises(tb.KernelSignatureError, match="new_required_thing"):
        tb.build_kernel_kwargs(future, values)


# --------------------------------------------------------------------------------------------
# The backend on capture files
# --------------------------------------------------------------------------------------------


def test_backend_replays_a_capture_and_observed_equals_triton_bit_for_bit(tmp_path):
    """A capture whose `out` the kernel itself produced replays as triton == observed, bit for bit."""
    spec = make_case("kimi-k2-tp8", torch.bfloat16, 256, "trailing-empty", 0.0, seq_lens=(300, 33))
    t = make_inputs(spec)
    t["out"], _, _, _ = run_kernel(spec, t)
    write_capture(tmp_path / "c.safetensors", {**t, "out": t["out"].cpu()}, make_meta(spec), compact=True)
    cap = read_capture(tmp_path / "c.safetensors")
    res = tb.TritonBackend().run(cap, ReplayOptions(cu_count=256))
    assert torch.equal(_bits(res.out), _bits(cap.out))
    assert res.info["num_kv_splits_source"] == "capture" and not res.defines_empty_rows
    assert res.info["sglang_version"] and res.info["kernel_module"] in triton_interp.KERNEL_MODULES
    assert res.attn_logits.shape[2] == res.info["splits_used"] == 10  # ceil(300 / 32)


def test_backend_computes_splits_when_the_capture_has_none(tmp_path):
    spec = make_case("deepseek-v3-tp8", torch.float16, 1, "n1", 0.0, seq_lens=(200, 64, 5))
    t = make_inputs(spec)
    del t["num_kv_splits"]
    write_capture(tmp_path / "c.safetensors", t, make_meta(spec), compact=False)
    cap = read_capture(tmp_path / "c.safetensors")
    res = tb.TritonBackend().run(cap, ReplayOptions(cu_count=256))
    assert res.info["num_kv_splits_source"].startswith("computed")
    expected = schedule.default_num_kv_splits(cap.seq_lens, max_kv_splits=16, num_heads=16, cu_count=256)
    assert torch.equal(res.num_kv_splits, expected)
    cmp = check_output(spec, {**t, "num_kv_splits": expected}, res.out)
    assert cmp.passed, cmp.summary()


def test_backend_refuses_extend_captures(tmp_path):
    spec = SynthSpec(name="x", seq_lens=(40, 9), new_tokens=2, num_heads=8)
    t = make_inputs(spec)
    write_capture(tmp_path / "e.safetensors", t, make_meta(spec), compact=False)
    with pytest.raises(BackendUnavailable, match="extend"):
        tb.TritonBackend().run(read_capture(tmp_path / "e.safetensors"), ReplayOptions(cu_count=256))


def test_ensure_interpreter_is_stable():
    again = triton_interp.ensure_interpreter()
    assert again[0] == INTERPRETING, again
