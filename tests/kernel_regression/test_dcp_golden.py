"""The context-parallel golden (golden/dcp/) x every golden backend: each backend runs on every DCP
rank's shard, the ranks' outputs are combined as vLLM combines them, and the step is judged as
``refmla replay FOLDER`` judges one (docs/context-parallel.md); ``reference`` is the self-check. The
case regenerates to the same bytes."""

from __future__ import annotations

from pathlib import Path

import pytest

from refmla import golden
from refmla.backends import named, plugin_defaults
from refmla.golden import dcp

DCP_DIR = Path(__file__).resolve().parents[2] / "golden" / "dcp"
CASES = [c["folder"] for c in dcp.load_manifest(DCP_DIR)["cases"]]

# the interpreter evaluates masked-off lanes too (-inf - -inf); the kernel masks the results
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")


def pytest_generate_tests(metafunc) -> None:
    """The backends ``--backend`` names (as tests/kernel_regression/test_golden.py takes them), else
    the golden backends and the installed packages' kernels; each x every DCP case."""
    if "dcp_backend" not in metafunc.fixturenames:
        return
    try:
        chosen = metafunc.config.getoption("--backend")
    except ValueError:  # not registered: pytest started above tests/kernel_regression
        chosen = None
    asked = [b for b in chosen if b in golden.CHECK_BACKENDS or named.known(b)] if chosen else \
        [*golden.CHECK_BACKENDS, *plugin_defaults()]  # fmt: skip
    params = [pytest.param(case, b, marks=() if b == "reference" else pytest.mark.slow, id=f"{case}-{b}")
              for case in CASES for b in dict.fromkeys(asked) if dcp.applies(b)]  # fmt: skip
    metafunc.parametrize(("case", "dcp_backend"), params)


def test_dcp_golden(case, dcp_backend):
    backend = dcp_backend
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
