"""Shape-conditional regressions planted in the real kernels of the sweep's block_table and sparse
layouts, for the sweep's tests.

As tests/planted_sglang.py does, nothing is copied: at test time the installed kernel module's
source is read, one line of one kernel is edited, and the edited source is imported under a name of
its own (Triton's jit reads a function's source from its file); refmla's own backend then runs the
planted copy under the backend's usual name, so ``refmla sweep`` checks it as it would the
installed kernel. Each plant shows only on some shapes:

    split_floor  vLLM's TRITON_MLA stage 1 sizes its splits ceil(L / S) -> floor(L / S): where S
                 does not divide L the tail of the request is never attended (stage 2 still merges
                 on the ceil schedule); one split is right, so the verdict moves with the split count
    tail_block   SGLang's DeepSeek-V4 Triton sparse kernel, single-scope path (a window-only layer):
                 its early exit skips the last block of 32 entries unless the block is whole
                 (``n_start + BLOCK_N <= topk_len`` for ``n_start < topk_len``): a row whose
                 topk_length is not a multiple of 32 loses its last entries; the dual-scope kernels
                 (C4 / C128 layers) are untouched

The check each must fail is :data:`EXPECTED`; :data:`QUICK_SPACE` narrows the space to two points,
one each side of the edge.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import sys
import tempfile
from pathlib import Path

from refmla.backends import triton_interp
from refmla.backends import vllm_triton as vt

VLLM_MODULE = vt.KERNEL_MODULES[0]
SPARSE_FUSED = "sglang.kernels.ops.attention.dsv4.triton_sparse_decode.triton_mla_kernels_decode_fused"
SPARSE_OPTIMIZED = "sglang.kernels.ops.attention.dsv4.triton_sparse_decode.triton_mla_kernels_decode_optimized"

# plant -> (module, kernel function, the line as the engine writes it, the line as planted)
PLANTS = {
    "split_floor": (VLLM_MODULE, "_fwd_grouped_kernel_stage1", "kv_len_per_split = tl.cdiv(cur_batch_seq_len, NUM_KV_SPLITS)",
                    "kv_len_per_split = cur_batch_seq_len // NUM_KV_SPLITS"),
    "tail_block": (SPARSE_FUSED, "_fused_gather_attn_dsv4_kernel", "should_compute = not HAS_TOPK_LENGTH or n_start < topk_len",
                   "should_compute = not HAS_TOPK_LENGTH or n_start + BLOCK_N <= topk_len"),
}  # fmt: skip
LAYOUT = {"split_floor": "block_table", "tail_block": "sparse"}
EXPECTED = {"split_floor": "splits", "tail_block": "reference"}
QUICK_SPACE = {
    "split_floor": ["heads=16", "page=16", "length=page+1", "batch=1", "splits=1,3", "kv=bfloat16",
                    "table=shuffled", "null=nan"],
    "tail_block": ["cache=v4-swa", "heads=16", "topk=128", "length=64,65", "batch=1", "page=256", "sink=on",
                   "topk_length=given"],
}  # fmt: skip

_DIR = Path(tempfile.mkdtemp(prefix="refmla-planted-layouts-"))


def planted_module(plant: str, plants: dict = PLANTS):
    """The installed kernel module with ``plant`` (of ``plants``) edited in, imported under a name of its own."""
    module, func, old, new = plants[plant]
    triton_interp.ensure_interpreter()
    src = inspect.getsource(importlib.import_module(module))
    start = src.index(f"def {func}(")
    end = src.find("\ndef ", start + 1)
    body = src[start:end]
    assert body.count(old) == 1, f"{plant}: {old!r} not once in {func} of {module}"
    src = src[:start] + body.replace(old, new) + src[end:]
    name = f"refmla_planted_{plant}_{hashlib.sha1(src.encode()).hexdigest()[:8]}"
    if name in sys.modules:
        return sys.modules[name]
    path = _DIR / f"{name}.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


class PlantedVllm(vt.VllmTritonBackend):
    """refmla's ``vllm_triton`` backend calling the planted copy of vLLM's kernel module."""

    def __init__(self, plant: str, plants: dict = PLANTS):
        self.plant, self.plants = plant, plants

    def run(self, cap, opts):
        mod = planted_module(self.plant, self.plants)
        located = vt.locate_vllm_kernel
        _, _, version = located()
        vt.locate_vllm_kernel = lambda: (mod.decode_attention_fwd, mod.__name__, f"{version} planted {self.plant}")
        try:
            res = super().run(cap, opts)
        finally:
            vt.locate_vllm_kernel = located
        res.info["planted"] = self.plant
        return res


def planted_sparse_triton(plant: str):
    """refmla.sparse.backends.run_triton calling the planted copy of SGLang's fused sparse kernels."""
    from refmla.sparse import backends as sb

    def run(cap):
        mod = planted_module(plant)
        opt = importlib.import_module(SPARSE_OPTIMIZED)
        names = [n for n in vars(opt) if n.startswith("fused_gather_attn_decode_dsv4")]
        saved = {n: getattr(opt, n) for n in names}
        try:
            for n in names:
                setattr(opt, n, getattr(mod, n))
            with sb.one_config_each(mod.__name__, triton_interp.interpreter_active()):
                got = sb.run_triton(cap)
        finally:
            for n, f in saved.items():
                setattr(opt, n, f)
        got.info["planted"] = plant
        return got

    return run


def install(plant: str) -> None:
    """Make the layout's backend run the planted kernel in this process (a sweep's ``setup``:
    ``planted_layouts:install:<plant>``, run again in every worker)."""
    import refmla.backends as backends
    from refmla.sparse import backends as sb

    if LAYOUT[plant] == "block_table":
        backends._CACHE["vllm_triton"] = PlantedVllm(plant)
    else:
        sb.BACKENDS["triton"] = planted_sparse_triton(plant)


__all__ = ["EXPECTED", "LAYOUT", "PLANTS", "QUICK_SPACE", "PlantedVllm", "install", "planted_module", "planted_sparse_triton"]
