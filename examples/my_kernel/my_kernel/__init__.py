"""my_kernel: a split-KV Triton MLA decode over a block table (my_kernel.decode)."""

from my_kernel.decode import decode

__all__ = ["decode"]
