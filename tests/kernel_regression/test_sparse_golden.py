"""Every sparse golden (golden/sparse/: DeepSeek-V4-Flash C4 / C128, V3.2 DSA) x every sparse backend:
``reference`` reproduces the stored fp64 reference to one fp32 ulp; SGLang's Triton sparse kernel
(interpreted on CPU), aiter's sparse kernel and tilelang (skipped with the reason where absent) stay
within k x the control's error of it."""

from __future__ import annotations

from pathlib import Path

import pytest

from refmla.golden import sparse as golden

SPARSE_DIR = Path(__file__).resolve().parents[2] / "golden" / "sparse"
CASES = [c["file"] for c in golden.load_manifest(SPARSE_DIR)["cases"]]


@pytest.mark.parametrize("backend", golden.CHECK_BACKENDS)
@pytest.mark.parametrize("name", CASES)
def test_sparse_golden(name, backend):
    result = golden.check(SPARSE_DIR / name, backend)
    if result.status == "skipped":
        pytest.skip(f"{backend}: {result.reason}")
    assert result.passed, f"{name} {backend}: {result.reason}"


def test_sparse_goldens_regenerate_to_the_same_bytes(tmp_path):
    golden.generate(tmp_path)
    for name in CASES + [golden.MANIFEST]:
        assert (tmp_path / name).read_bytes() == (SPARSE_DIR / name).read_bytes(), name
