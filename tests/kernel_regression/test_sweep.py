"""`refmla sweep` in pytest: each selected ``--backend`` swept for ``--sweep-budget`` seconds over
the production shape space, one test per (backend, check). A failing test names the shrunk
capture and the command that replays it. Without ``--backend`` the sweep checks ``triton`` (the
kernel that runs on every machine); on an MI355X: ``--backend aiter --sweep-budget 600``
(docs/golden.md). Installed packages' kernels (entry points of ``refmla.backends``) are swept by
default too, and ``--backend module:function`` names a kernel outside refmla (docs/own-kernel.md)."""

from __future__ import annotations

import pytest

from refmla.backends import named, plugin_defaults
from refmla.sweep import CHECKS, SweepConfig, run_sweep
from refmla.sweep.kernels import NAMES

DEFAULT_BACKENDS = ("triton",)

# the interpreter evaluates masked-off lanes too (-inf - -inf); the kernel masks the results
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")


def _option(config, name, default=None):
    try:
        return config.getoption(name)
    except ValueError:
        return default


def pytest_generate_tests(metafunc) -> None:
    if "sweep_backend" not in metafunc.fixturenames:
        return
    asked = _option(metafunc.config, "--backend") or (*DEFAULT_BACKENDS, *plugin_defaults())
    chosen = [b for b in asked if b in NAMES or named.known(b)]
    pairs = [pytest.param(b, c, marks=() if b == "reference" else pytest.mark.slow, id=f"{b}-{c}")
             for b in dict.fromkeys(chosen) for c in CHECKS]  # fmt: skip
    metafunc.parametrize(("sweep_backend", "check"), pairs)


_REPORTS: dict = {}


@pytest.fixture
def swept(request, tmp_path_factory):
    """The sweep report of the test's backend, run once per session."""
    backend = request.getfixturevalue("sweep_backend")
    if backend not in _REPORTS:
        budget = float(_option(request.config, "--sweep-budget", 8.0))
        out = tmp_path_factory.mktemp(f"sweep-{backend}")
        _REPORTS[backend] = run_sweep(SweepConfig(backends=[backend], budget=budget, out=str(out), max_shrink=8))
    return _REPORTS[backend]


def test_sweep(swept, sweep_backend, check):
    b = swept.backends[sweep_backend]
    if not b.available:  # not installed here, or a GPU kernel on a CPU-only machine
        pytest.skip(f"{sweep_backend}: {b.reason}")
    counts = b.counts.get(check, {})
    ran = counts.get("pass", 0) + counts.get("fail", 0) + counts.get("error", 0)
    assert swept.cases, f"the sweep of {sweep_backend} ran no case in its budget"
    found = [f for f in b.findings if f.check == check]
    if found:
        f = found[0]
        pytest.fail(f"{sweep_backend} fails {check} on {f.failing_cases} case(s): {f.detail}\n"
                    f"shrunk: {f.shrunk}\ncapture: {f.capture}\nreplay: {f.replay_command}", pytrace=False)  # fmt: skip
    if not ran:
        pytest.skip(f"{sweep_backend}: the {check} check does not apply ({counts})")
