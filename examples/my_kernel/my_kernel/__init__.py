"""my_kernel: a split-KV Triton MLA decode over a block table (my_kernel.decode) and a sparse top-k
MLA decode in PyTorch (my_kernel.sparse)."""

from my_kernel.decode import decode

__all__ = ["decode"]
