"""SGLang's own Triton MLA decode kernel with one regression planted in it, for tests only.

Nothing of SGLang is copied into the repository: at test time the installed kernel module's
source is read, one line of one stage is edited (:data:`PLANTS`), and the edited source is
written to a temporary module and imported (Triton's jit reads a function's source from its
file). The planted kernel is then run through refmla's own ``triton`` backend by a test-only
backend class (:class:`PlantedTriton`), so the replay sees a kernel it was not built for.

Each plant is a regression a kernel engineer could write:

    oob_index      stage 1 reads its slots 2**40 entries past kv_indices (an offset added in the
                   wrong unit): every load is out of bounds, and the interpreted kernel segfaults
    stage1_mask    stage 1 masks off the last position of every split (< end - 1, not < end)
    stage1_lse     stage 1 stores the split's lse with log2 where the merge expects ln
    stage2_merge   stage 2 forgets to rescale the running sum when the maximum moves
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import sys
import tempfile
from pathlib import Path

from refmla.backends import triton as tb
from refmla.backends import triton_interp
from refmla.backends.triton import TritonBackend

# plant -> (kernel function, the line as SGLang writes it, the line as planted)
PLANTS = {
    "oob_index": ("_fwd_grouped_kernel_stage1", "kv_indices + cur_batch_kv_start_idx + offs_n,",
                  "kv_indices + cur_batch_kv_start_idx + offs_n + (1 << 40),"),
    "stage1_mask": ("_fwd_grouped_kernel_stage1", 'mask_h[:, None] & (offs_n[None, :] < split_kv_end), qk, float("-inf")',
                    'mask_h[:, None] & (offs_n[None, :] < split_kv_end - 1), qk, float("-inf")'),
    "stage1_lse": ("_fwd_grouped_kernel_stage1", "e_max + tl.log(e_sum),", "e_max + tl.log2(e_sum),"),
    "stage2_merge": ("_fwd_kernel_stage2", "e_sum = e_sum * old_scale + exp_logic", "e_sum = e_sum + exp_logic"),
}  # fmt: skip
STAGE = {"stage1_mask": "stage1", "stage1_lse": "stage1_lse", "stage2_merge": "stage2", "oob_index": "stage1"}

_DIR = Path(tempfile.mkdtemp(prefix="refmla-planted-"))


def planted_module(plant: str, plants: dict = PLANTS):
    """The installed kernel module with ``plant`` (of ``plants``) edited in, imported under a name of its own."""
    func, old, new = plants[plant]
    triton_interp.ensure_interpreter()
    _, module_path, _ = tb.locate_decode_kernel()
    src = inspect.getsource(sys.modules[module_path])
    start = src.index(f"def {func}(")
    end = src.find("\ndef ", start + 1)
    body = src[start:end]
    assert body.count(old) == 1, f"{plant}: {old!r} not once in {func} of {module_path}"
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


class PlantedTriton(TritonBackend):
    """refmla's ``triton`` backend, calling the planted copy of the kernel instead of SGLang's."""

    def __init__(self, plant: str, plants: dict = PLANTS):
        self.plant, self.plants = plant, plants
        self.name = f"triton_{plant}"

    def run(self, cap, opts):
        mod = planted_module(self.plant, self.plants)
        _, _, version = tb.locate_decode_kernel()
        saved = tb._located
        tb._located = (mod.decode_attention_fwd, mod.__name__, f"{version} planted {self.plant}")
        try:
            res = super().run(cap, opts)
        finally:
            tb._located = saved
        res.info["planted"] = self.plant
        return res


def register(monkeypatch, *plants: str) -> list[str]:
    """Make ``triton_<plant>`` a backend name for this test (the replay picks backends by name)."""
    import refmla.backends as backends
    import refmla.pipeline as replay

    names = [f"triton_{p}" for p in plants]
    for p, n in zip(plants, names):
        monkeypatch.setitem(backends._CACHE, n, PlantedTriton(p))
        monkeypatch.setitem(backends._WHERE, n, f"planted_sglang:{p}")
    monkeypatch.setattr(replay, "ALL_NAMES", tuple(replay.ALL_NAMES) + tuple(names))
    return names


def replay_with_plants(path: str, opts):
    """A picklable batch task (refmla.batch.replay_many): register every plant in this (worker)
    process, then replay as ``refmla replay`` does."""
    import refmla.backends as backends
    import refmla.pipeline as replay
    from refmla.batch import replay_one

    for p in PLANTS:
        backends._CACHE[f"triton_{p}"] = PlantedTriton(p)
        backends._WHERE[f"triton_{p}"] = f"planted_sglang:{p}"
    replay.ALL_NAMES = tuple(dict.fromkeys(tuple(replay.ALL_NAMES) + tuple(f"triton_{p}" for p in PLANTS)))
    return replay_one(path, opts)
