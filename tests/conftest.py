"""Shared test setup. The Triton interpreter must be chosen before anything imports triton."""

import os
import sys

try:
    from refmla.backends.triton_interp import ensure_interpreter
except ImportError:  # the triton backend module is optional
    pass
else:
    ensure_interpreter()

sys.path.insert(0, os.path.dirname(__file__))  # tests/helpers.py
