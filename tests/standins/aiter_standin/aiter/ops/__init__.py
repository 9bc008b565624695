"""STAND-IN (tests only): aiter.ops."""
