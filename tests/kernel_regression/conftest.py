"""The kernel-regression suite: every golden file x every backend (docs/golden.md).

Options (pytest registers them when it starts from this folder or a path inside it, e.g.
``pytest tests/kernel_regression``; for a bare ``pytest`` they must come from tests/conftest.py):

    --backend NAME      run only this backend (repeatable): a golden backend (reference, triton, aiter,
                        extend, the per-query paths), any name `refmla sweep --backend` takes, or a
                        kernel outside refmla (module:function, file.py:function, an installed
                        package's entry point: those join the defaults; docs/own-kernel.md)
    --golden-dir DIR    the golden directory (default: golden/ at the repository root)
    --regen             rewrite the goldens in DIR first (its manifest's suite), then test them
    --sweep-budget S    seconds each selected backend is swept for by test_sweep.py (default 8)
"""

from __future__ import annotations

from pathlib import Path

try:  # the Triton interpreter must be chosen before anything imports triton
    from refmla.backends.triton_interp import ensure_interpreter
except ImportError:
    pass
else:
    ensure_interpreter()

import pytest

from refmla import golden
from refmla.backends import named, plugin_defaults
from refmla.backends.named import Choices
from refmla.sweep.kernels import NAMES as SWEEP_NAMES

DEFAULT_GOLDEN_DIR = Path(__file__).resolve().parents[2] / "golden"
DEFAULT_SWEEP_BUDGET = 8.0  # make test stays fast; an MI355X image deserves --sweep-budget 600 (docs/golden.md)


def add_golden_options(parser) -> None:
    """The suite's options, once; tests/conftest.py may call this too, so that a bare ``pytest`` knows them."""
    group = parser.getgroup("golden", "refmla kernel-regression suite (tests/kernel_regression)")
    if any("--golden-dir" in opt.names() for opt in group.options):
        return
    group.addoption(
        "--backend",
        action="append",
        default=None,
        choices=Choices(dict.fromkeys((*golden.CHECK_BACKENDS, *SWEEP_NAMES))),  # and module:function kernels
        metavar="NAME",
        help=f"backend to check against the goldens (repeatable; default all: {', '.join(golden.CHECK_BACKENDS)}) "
        "and to sweep in test_sweep.py (any name `refmla sweep --backend` takes; default triton); "
        "or your kernel as module:function (docs/own-kernel.md); installed packages' kernels join the defaults",
    )
    group.addoption(
        "--golden-dir", default=None, metavar="DIR", help=f"golden directory (default {DEFAULT_GOLDEN_DIR})"
    )
    group.addoption("--regen", action="store_true", help="regenerate the goldens in --golden-dir, then test them")
    group.addoption("--sweep-budget", type=float, default=DEFAULT_SWEEP_BUDGET, metavar="S",
                    help=f"seconds of `refmla sweep` per backend in test_sweep.py (default {DEFAULT_SWEEP_BUDGET:g})")


def pytest_addoption(parser) -> None:
    add_golden_options(parser)


def _option(config, name: str, default=None):
    try:
        return config.getoption(name)
    except ValueError:  # not registered: pytest started above this folder (see the docstring)
        return default


def golden_dir(config) -> Path:
    return Path(_option(config, "--golden-dir") or DEFAULT_GOLDEN_DIR)


def pytest_configure(config) -> None:
    if _option(config, "--regen") and not hasattr(config, "workerinput"):  # xdist: the controller only
        out = golden_dir(config)
        try:
            suite = golden.load_manifest(out).get("suite", "quick")
        except FileNotFoundError:
            suite = "quick"
        golden.generate(out, suite=suite)


def pytest_generate_tests(metafunc) -> None:
    if "golden_file" not in metafunc.fixturenames:
        return
    cases = golden.load_manifest(golden_dir(metafunc.config))["cases"]
    chosen = _option(metafunc.config, "--backend")  # a name only the sweep takes checks no golden
    defaults = (*golden.CHECK_BACKENDS, *plugin_defaults())  # refmla's and the installed packages' kernels
    backends = [b for b in chosen if b in golden.CHECK_BACKENDS or named.known(b)] if chosen else defaults
    slow = pytest.mark.slow  # kernels run in the Triton interpreter on a CPU-only machine
    pairs = [
        pytest.param(golden_dir(metafunc.config) / c["file"], b, marks=() if b == "reference" else slow,
                     id=f"{c['name']}-{b}")
        for c in cases
        for b in backends
        if golden.backend_applies(b, c["params"].get("mode", "decode"))
    ]  # fmt: skip
    metafunc.parametrize(("golden_file", "backend"), pairs)
