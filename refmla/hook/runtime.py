"""Read-only questions to the running process: graph capture, torch.compile, TP rank, versions.

Each answer is asked of SGLang (or torch) in the ways its releases offer, never raises, and
imports nothing that the server has not loaded already except light modules it would load anyway.
The rank and the capture-mode functions are looked up once per process.
"""

from __future__ import annotations

import importlib
import sys
from typing import Callable, Optional

from refmla.hook.sglang_paths import CAPTURE_MODE_PROBES

_capture_probes: Optional[list[Callable[[], bool]]] = None
_rank_cache: Optional[int] = None


def graph_capturing() -> bool:
    """True while a CUDA/HIP graph is being captured (torch's stream state or SGLang's flag)."""
    import torch

    try:
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return True
    except Exception:
        pass
    for probe in _capture_mode_probes():
        try:
            if probe():
                return True
        except Exception:
            pass
    return False


def _capture_mode_probes() -> list[Callable[[], bool]]:
    global _capture_probes
    if _capture_probes is None:
        found = []
        for module, attr in CAPTURE_MODE_PROBES:
            mod = sys.modules.get(module)
            if mod is None:
                try:
                    mod = importlib.import_module(module)  # light; imported by the runner anyway
                except Exception:
                    continue
            fn = getattr(mod, attr, None)
            if callable(fn):
                found.append(fn)
        _capture_probes = found
    return _capture_probes


def compiling() -> bool:
    """True while torch.compile is tracing (the wrapper then stays out of the graph)."""
    try:
        import torch

        return bool(torch.compiler.is_compiling())
    except Exception:
        return False


def _rank_getters() -> list[Callable[[], int]]:
    getters: list[Callable[[], int]] = []
    try:
        from sglang.srt.runtime_context import get_parallel  # 0.5.2x

        getters += [lambda: get_parallel().tp_rank, lambda: get_parallel().attn_tp_rank]
    except Exception:
        pass
    try:
        from sglang.srt.distributed import get_tensor_model_parallel_rank  # 0.4.x - 0.5.x

        getters.append(get_tensor_model_parallel_rank)
    except Exception:
        pass
    return getters


def tp_rank() -> int:
    """This process's tensor-parallel rank, asked of SGLang in the ways its releases offer."""
    global _rank_cache
    if _rank_cache is not None:
        return _rank_cache
    for g in _rank_getters():
        try:
            _rank_cache = int(g())
            return _rank_cache
        except Exception:
            continue
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            _rank_cache = int(dist.get_rank())
            return _rank_cache
    except Exception:
        pass
    return 0


def longest_seq_len(forward_batch) -> Optional[int]:
    """max(seq_lens) from the host copy when there is one (no device sync), else from the device."""
    cpu = getattr(forward_batch, "seq_lens_cpu", None)
    try:
        if cpu is not None and cpu.numel():
            return int(cpu.max())
        dev = getattr(forward_batch, "seq_lens", None)
        if dev is not None and dev.numel():
            return int(dev.max())
    except Exception:
        return None
    return None


def _dist_version(name: str) -> Optional[str]:
    """The installed distribution's version, or None when it is not installed (or unreadable)."""
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:
        return None


def versions() -> dict[str, str]:
    """``sglang_version``, ``aiter_version`` (only when the server loaded aiter), ``triton_version``."""
    out = {}
    v = _dist_version("sglang")
    if v is not None:
        out["sglang_version"] = v
    else:
        mod = sys.modules.get("sglang")
        if mod is not None and getattr(mod, "__version__", None):
            out["sglang_version"] = str(mod.__version__)
    aiter = sys.modules.get("aiter")  # never imported by us: only report what the server loaded
    if aiter is not None:
        v = getattr(aiter, "__version__", None) or _dist_version("amd-aiter")
        if v:
            out["aiter_version"] = str(v)
    try:
        import triton

        out["triton_version"] = str(triton.__version__)
    except Exception:
        pass
    return out
