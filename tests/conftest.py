"""Shared test setup. The Triton interpreter must be chosen before anything imports triton."""

import os
import sys

import pytest

try:
    from refmla.backends.triton_interp import ensure_interpreter
except ImportError:  # the triton backend module is optional
    pass
else:
    ensure_interpreter()

sys.path.insert(0, os.path.dirname(__file__))  # tests/helpers.py


def pytest_addoption(parser):
    """The kernel-regression suite's --backend / --golden-dir / --regen, so a bare `pytest` knows them."""
    from kernel_regression.conftest import add_golden_options  # tests/ is on sys.path (above)

    add_golden_options(parser)


@pytest.fixture
def standin(monkeypatch):
    """The aiter stand-in (tests/standins/aiter_standin) on sys.path for one test; its aiter.mla module."""
    from helpers import STANDINS, forget_aiter

    forget_aiter()
    # the stand-in records its calls in this process (mla.CALLS): run backends in-process, not in
    # refmla.isolation's child, whose calls the test could not see (the stand-in cannot crash)
    monkeypatch.setenv("REFMLA_ISOLATE", "0")
    monkeypatch.syspath_prepend(str(STANDINS / "aiter_standin"))
    from aiter import mla

    mla.CALLS.clear()
    yield mla
    forget_aiter()


@pytest.fixture(autouse=True)
def _kernels_in_process(request, monkeypatch):
    """Kernel backends run in-process in the suite, except in tests/test_isolation.py, which tests the
    forked and spawned children themselves. A child forked from this long-lived pytest process (which
    by then holds other threads: Inductor's, BLAS's) was seen to block forever on a lock it inherited
    (test_benign, a verify preset, in a fresh clone's CI): fork isolation is for the short-lived CLI
    process, and its own tests say what it does."""
    if request.node.path.name != "test_isolation.py":
        monkeypatch.setenv("REFMLA_ISOLATE", "0")


@pytest.fixture(autouse=True)
def _search_without_wall_clock(monkeypatch):
    """The sparse hypothesis search stops at a wall-clock budget (30 s, $REFMLA_SEARCH_SECONDS): a
    user's bound, kept by tools/bench_sparse.py. A test judges what the search names, which must not
    depend on how loaded the machine running the suite is; the tests of the budget set their own."""
    monkeypatch.setenv("REFMLA_SEARCH_SECONDS", "3600")
