"""Every golden file x every backend: the kernel must stay within k x the control's error of the
stored fp64 reference (docs/contract.md section 5). ``reference`` is the self-check: this machine's fp64
reference reproduces the stored one to one fp32 ulp. See docs/golden.md for the commands."""

from __future__ import annotations

import pytest

from refmla import golden

# the interpreter evaluates masked-off lanes too (-inf - -inf); the kernel masks the results
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")


def test_golden(golden_file, backend):
    isolate, no_room = golden.needs_isolation(golden_file)
    if no_room:
        pytest.skip(no_room)
    result = golden.check_isolated(golden_file, backend) if isolate else golden.check(golden_file, backend)
    if result.status == "skipped":
        pytest.skip(f"{backend}: {result.reason}")
    if not result.passed:
        pytest.fail(result.message(), pytrace=False)
