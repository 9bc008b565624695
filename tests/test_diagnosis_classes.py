"""Every registered kernel backend is classified: a failure of any one of them is a diagnosed divergence.

A name the diagnosis did not know once fell through to "all backends agree with the reference" while
the verdict was ``diverged``: a finding reported as a pass in the text.
"""

from __future__ import annotations

import pytest

from refmla.backends import ALL_NAMES, VERIFY_ONLY
from refmla.diagnosis import diagnose

KERNELS = [n for n in ALL_NAMES if n not in ("reference", "observed", "extend", *VERIFY_ONLY)]


@pytest.mark.parametrize("name", KERNELS)
def test_a_failing_kernel_alone_is_a_decode_divergence(name):
    d = diagnose({"reference": "pass", "observed": "pass", name: "fail"})
    assert d.name == "decode" and d.backends == [name] and name in d.text


@pytest.mark.parametrize("name", KERNELS)
def test_a_passing_kernel_clears_the_decode_path(name):
    d = diagnose({"reference": "pass", "observed": "fail", name: "pass"})
    assert d.name == "observed" and name in d.text


def test_an_unregistered_failing_backend_is_never_agreement():
    d = diagnose({"reference": "pass", "observed": "pass", "triton_x": "fail"})
    assert d.name is not None and d.backends == ["triton_x"]
