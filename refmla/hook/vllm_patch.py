"""The vLLM capture hook: vLLM's plugin entry point, and the ``forward_mqa`` wrapper.

vLLM runs every ``vllm.general_plugins`` entry point in each of its processes (API server, engine
core, workers; ``vllm.plugins.load_general_plugins``). refmla registers :func:`plugin` there
(pyproject.toml). With ``REFMLA_CAPTURE_DIR`` unset it returns at once: nothing is patched or
imported. With it set, the same :class:`~refmla.hook.config.HookConfig` as the SGLang hook
(``REFMLA_CAPTURE_LAYERS`` / ``EVERY`` / ``RANKS`` / ``MIN_SEQ_LEN`` / ``MAX_FILES`` /
``MAX_BYTES``) drives a post-import patch of each MLA ``Impl.forward_mqa`` of
:mod:`refmla.hook.vllm_paths`. Per call: inactive -> the original; inside CUDA-graph capture or
torch.compile tracing -> the original, noted once; else the original runs, its result is returned
untouched, and :func:`refmla.hook.vllm_extract.after` reads (never writes) the call. A Skip is
counted; any other exception disables the hook, logged once. Torch-free at install time.
"""

from __future__ import annotations

import logging
import re
from typing import Any, Callable, Optional

from refmla.hook.call import VllmCall, guarded
from refmla.hook.config import HookConfig
from refmla.hook.filters import GRAPH_NOTE
from refmla.hook.postimport import InstallSlot
from refmla.hook.runtime import compiling, graph_capturing
from refmla.hook.patching import call_patcher
from refmla.hook.vllm_paths import MARK, METHODS, VLLM_IMPLS, VLLM_KV_WRITERS, VLLM_MERGES
from refmla.hook.writer import HookState


_SLOT = InstallSlot()  # the hook's one installation in this process (refmla.hook.postimport)


def plugin() -> None:
    """vLLM's ``vllm.general_plugins`` entry point: install when REFMLA_CAPTURE_DIR is set. Never raises."""
    try:
        cfg = HookConfig.from_env()
        if cfg is not None:
            install(cfg)
    except Exception as e:  # a bad REFMLA_CAPTURE_* value must not stop vLLM
        logging.getLogger("refmla.hook").error("refmla capture hook not installed: %s", e)


def install(cfg: HookConfig) -> HookState:
    """Install in this process (idempotent)."""
    if _SLOT.current is not None:
        return _SLOT.state
    def targets() -> dict:
        found = {module: _patcher(*spec) for module, spec in VLLM_IMPLS.items()}
        for kind, table in (("kvwrite", VLLM_KV_WRITERS), ("merge", VLLM_MERGES)):
            if kind in cfg.backends:
                found.update({module: call_patcher(_SLOT, kind, entries) for module, entries in table.items()})
        return found

    inst = _SLOT.install(cfg.out_dir, lambda: HookState(cfg), targets, on_error=_SLOT.fail)
    inst.state.log.info("vLLM capture hook active: dir=%s", cfg.out_dir)
    return inst.state


def uninstall() -> None:
    import sys

    held = sys.modules.get("refmla.hook.dcp_combine")  # loaded only once a DCP call was captured
    if held is not None:
        held.flush()  # a rank's capture still waiting for its combine: written as it is
    _SLOT.uninstall()


def installed_patches() -> Optional[list]:
    """The current installation's (owner, name, original) list (restored on uninstall), or None."""
    inst = _SLOT.current
    return inst.patched if inst is not None else None


def current_state() -> Optional[HookState]:
    return _SLOT.state


def _patcher(cls_name: str, engine_backend: str, backend: str) -> Callable[[Any], None]:
    def patch(module) -> None:
        inst = _SLOT.current
        cls = getattr(module, cls_name, None) if inst is not None else None
        if cls is None:
            return
        for name in METHODS:
            original = cls.__dict__.get(name)
            if original is not None and getattr(original, MARK, None) is None:
                wrapper = _wrapper(original, backend, engine_backend)
                setattr(wrapper, MARK, original)
                wrapper.__wrapped__ = original  # type: ignore[attr-defined]
                setattr(cls, name, wrapper)
                inst.patched.append((cls, name, original))
                inst.state.log.info("wrapped %s.%s.%s (%s)", module.__name__, cls_name, name, engine_backend)
                return

    return patch


def layer_index(layer: Any) -> int:
    """The layer number in vLLM's ``layer_name`` ("model.layers.3.self_attn.attn" -> 3), else -1."""
    found = re.findall(r"\.(\d+)\.", "." + str(getattr(layer, "layer_name", "")) + ".")
    return int(found[-1]) if found else -1


def _before(state: HookState, backend: str, engine_backend: str, layer: Any) -> Optional[VllmCall]:
    if graph_capturing():
        state.once("graph", logging.WARNING, GRAPH_NOTE.replace("--disable-cuda-graph", "--enforce-eager"))
        return None
    if compiling():
        state.once("compile", logging.WARNING, "torch.compile is tracing the attention: not captured there")
        return None
    layer_id = layer_index(layer)
    step = state.next_step(backend, layer_id)
    if not state.cfg.wants_layer(layer_id) or step % state.cfg.every:
        return None
    rank = _tp_rank()
    if not state.cfg.wants_rank(rank):
        return None
    return VllmCall(backend, engine_backend, layer, layer_id, step, rank)


def _tp_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except Exception:
        return 0


def _wrapper(original: Callable, backend: str, engine_backend: str) -> Callable:
    def forward_mqa(self, q, kv_c_and_k_pe_cache, attn_metadata, layer, *args, **kwargs):
        inst = _SLOT.current
        state = inst.state if inst is not None else None
        if state is None or not state.active:
            return original(self, q, kv_c_and_k_pe_cache, attn_metadata, layer, *args, **kwargs)
        call = None
        try:
            call = _before(state, backend, engine_backend, layer)
        except Exception as e:
            state.fail(e)
        result = original(self, q, kv_c_and_k_pe_cache, attn_metadata, layer, *args, **kwargs)
        if call is None:
            return result
        with guarded(state):
            from refmla.hook.vllm_extract import after

            after(state, call, self, (q, kv_c_and_k_pe_cache, attn_metadata), result, installed_patches())
        return result

    forward_mqa.__name__ = getattr(original, "__name__", "forward_mqa")
    forward_mqa.__qualname__ = getattr(original, "__qualname__", "forward_mqa")
    return forward_mqa


__all__ = ["current_state", "install", "installed_patches", "layer_index", "plugin", "uninstall"]
