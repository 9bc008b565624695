"""STAND-IN for ROCm aiter (tests only): no kernels, only the calling conventions of aiter.mla.

See tests/standins/README.md. refmla's aiter adapter accepts it on CPU because of the marker below.
"""

__refmla_standin__ = True
__version__ = "0.1.11-standin"
