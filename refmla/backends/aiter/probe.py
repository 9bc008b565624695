"""Finding ROCm aiter: the module, its version, whether it is the test stand-in.

The real aiter is recognised by ``aiter.mla`` (the PyPI package named ``aiter`` is unrelated and
has none). It needs a ROCm GPU. A module marking itself ``__refmla_standin__ = True`` (the test
stand-in in tests/standins/) is accepted on CPU and reported as a stand-in everywhere.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

from refmla.backends.base import BackendUnavailable


def locate_aiter() -> tuple[Any, str, bool]:
    """(the aiter.mla module, aiter version, is a stand-in). Raises BackendUnavailable saying why not."""
    try:
        aiter = importlib.import_module("aiter")
    except ModuleNotFoundError as e:
        if e.name == "aiter":
            raise BackendUnavailable("aiter is not installed (ROCm only; ships in SGLang's ROCm image)") from None
        raise BackendUnavailable(f"aiter import failed: {e}") from None
    except Exception as e:
        raise BackendUnavailable(f"aiter import failed: {type(e).__name__}: {e}") from None
    try:
        mla = importlib.import_module("aiter.mla")
    except Exception as e:
        raise BackendUnavailable(
            f"the installed 'aiter' ({getattr(aiter, '__file__', '?')}) has no usable aiter.mla "
            f"({type(e).__name__}: {e}); it is not ROCm aiter (never pip install aiter)"
        ) from None
    if not callable(getattr(mla, "mla_decode_fwd", None)):
        raise BackendUnavailable("aiter.mla has no mla_decode_fwd")
    standin = bool(getattr(aiter, "__refmla_standin__", False))
    return mla, _aiter_version(aiter), standin


def _aiter_version(aiter) -> str:
    v = getattr(aiter, "__version__", None)
    if v:
        return str(v)
    try:
        from importlib.metadata import version

        return version("amd-aiter")
    except Exception:
        return "unknown"


def available_paths(mla: Any) -> list[str]:
    """The decode paths (refmla.backends.aiter.paths) this aiter has the functions for. Never raises."""
    import importlib.util
    import inspect

    paths = ["non_persistent"]
    try:
        aiter = importlib.import_module("aiter")
        takes_work = "work_meta_data" in inspect.signature(mla.mla_decode_fwd).parameters
        if takes_work and callable(getattr(aiter, "get_mla_metadata_v1", None)):
            paths.insert(0, "persistent")
        if importlib.util.find_spec("aiter.ops.triton.gluon.mla_gluon") is not None:
            paths.append("gluon")
    except Exception:
        pass
    return paths


def aiter_status() -> tuple[bool, str]:
    """(usable here, version or reason; with the decode paths it can replay). Never raises."""
    try:
        mla, version, standin = locate_aiter()
    except BackendUnavailable as e:
        return False, str(e)
    paths = "paths: " + ", ".join(available_paths(mla))
    if standin:
        return True, f"STAND-IN aiter {version} (tests only: computes the reference, not a kernel); {paths}"
    if not (torch.cuda.is_available() and getattr(torch.version, "hip", None)):
        return False, f"aiter {version} found but no ROCm GPU (torch {torch.__version__})"
    return True, f"aiter {version} aiter.mla.mla_decode_fwd on {torch.cuda.get_device_name(0)}; {paths}"


__all__ = ["aiter_status", "available_paths", "locate_aiter"]
