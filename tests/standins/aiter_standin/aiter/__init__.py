"""STAND-IN for ROCm aiter (tests only): no kernels, only the calling conventions of aiter.mla.

See tests/standins/README.md. refmla's aiter adapter accepts it on CPU because of the marker below.
"""

__refmla_standin__ = True
__version__ = "0.1.11-standin"

from aiter.ops.attention import get_mla_metadata_info_v1, get_mla_metadata_v1  # noqa: E402,F401
