"""Every sparse golden (golden/sparse/: DeepSeek-V4-Flash C4 / C128, V3.2 DSA) x every sparse backend:
``reference`` reproduces the stored fp64 reference to one fp32 ulp; SGLang's Triton sparse kernel
(interpreted on CPU), aiter's sparse kernel and tilelang (skipped with the reason where absent) stay
within k x the control's error of it. A sparse top-k kernel outside refmla (refmla.kernel layout
``sparse_topk``) named with ``--backend``, or installed, joins them, judged through the one
replay's path (refmla.golden.sparse.kernel_entry)."""

from __future__ import annotations

from pathlib import Path

import pytest

from refmla.backends import is_sparse_kernel, plugin_defaults
from refmla.golden import sparse as golden

SPARSE_DIR = Path(__file__).resolve().parents[2] / "golden" / "sparse"
CASES = [c["file"] for c in golden.load_manifest(SPARSE_DIR)["cases"]]


def pytest_generate_tests(metafunc) -> None:
    if "sparse_backend" not in metafunc.fixturenames:
        return
    try:
        chosen = metafunc.config.getoption("--backend")
    except ValueError:  # the suite's options not registered (pytest started above tests/)
        chosen = None
    mine = [b for b in dict.fromkeys(chosen) if is_sparse_kernel(b)] if chosen else list(plugin_defaults(sparse=True))
    metafunc.parametrize("sparse_backend", [*golden.CHECK_BACKENDS, *mine])


@pytest.mark.parametrize("name", CASES)
def test_sparse_golden(name, sparse_backend):
    backend = sparse_backend
    result = golden.check(SPARSE_DIR / name, backend)
    if result.status == "skipped":
        pytest.skip(f"{backend}: {result.reason}")
    assert result.passed, f"{name} {backend}: {result.reason}"


def test_sparse_goldens_regenerate_to_the_same_bytes(tmp_path):
    golden.generate(tmp_path)
    for name in CASES + [golden.MANIFEST]:
        assert (tmp_path / name).read_bytes() == (SPARSE_DIR / name).read_bytes(), name
