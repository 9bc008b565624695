"""STAND-IN for ``flashinfer`` (tests only): see flashinfer.decode."""
__refmla_standin__ = True
