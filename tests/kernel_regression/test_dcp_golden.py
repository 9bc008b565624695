"""The context-parallel golden (golden/dcp/) x every golden backend: each backend runs on every DCP
rank's shard, the ranks' outputs are combined as vLLM combines them, and the step is judged as
``refmla replay FOLDER`` judges one (docs/context-parallel.md); ``reference`` is the self-check. The
case regenerates to the same bytes."""

from __future__ import annotations

from pathlib import Path

import pytest

from refmla.golden import dcp

DCP_DIR = Path(__file__).resolve().parents[2] / "golden" / "dcp"
CASES = [c["folder"] for c in dcp.load_manifest(DCP_DIR)["cases"]]
BACKENDS = [b for b in ("reference", "triton", "aiter", "extend") if dcp.applies(b)]

# the interpreter evaluates masked-off lanes too (-inf - -inf); the kernel masks the results
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")


@pytest.mark.parametrize("backend", [pytest.param(b, marks=() if b == "reference" else pytest.mark.slow)
                                     for b in BACKENDS])  # fmt: skip
@pytest.mark.parametrize("case", CASES)
def test_dcp_golden(case, backend):
    result = dcp.check(DCP_DIR / case, backend)
    if result.status == "skipped":
        pytest.skip(f"{backend}: {result.reason}")
    assert result.passed, result.message()


def test_dcp_goldens_regenerate_to_the_same_bytes(tmp_path):
    dcp.generate(tmp_path)
    for case in CASES:
        for f in sorted((DCP_DIR / case).iterdir()):
            assert (tmp_path / case / f.name).read_bytes() == f.read_bytes(), f"{case}/{f.name}"
    assert (tmp_path / dcp.MANIFEST).read_bytes() == (DCP_DIR / dcp.MANIFEST).read_bytes()
