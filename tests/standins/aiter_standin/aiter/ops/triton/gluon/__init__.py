"""STAND-IN (tests only): aiter.ops.triton.gluon."""
