"""STAND-IN for the unrelated PyPI package named ``aiter`` (tests only): it has no ``aiter.mla``."""

__version__ = "0.0.0-not-rocm"
