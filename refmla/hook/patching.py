"""Installing the hook: wrap SGLang's backends' ``forward_decode`` / ``forward_extend`` and probe its kernel.

:func:`install` registers a :class:`~refmla.hook.postimport.PostImportFinder` for the modules of
:mod:`refmla.hook.sglang_paths` (patched the moment SGLang imports them, or at once when it
already has); nothing of SGLang is imported by the hook itself. :func:`uninstall` restores every
original. The wrapper finds ``q``, ``k``, ``layer``, ``forward_batch`` and ``sinks`` by name through
the original's signature and passes every argument through untouched. Per call:

1. inactive (stopped, disabled) -> straight to the original;
2. before the kernel: :func:`refmla.hook.filters.before` (cheap filters, no device work, no sync);
3. the original runs, its result is returned as it is;
4. after it: :func:`refmla.hook.extract.after` reads (never writes) what ran and writes the capture.
   A :class:`~refmla.hook.call.Skip` is counted; any other exception disables the hook, once, logged.

This module and those it imports are torch-free (they run at interpreter start-up under
``refmla capture run``); :mod:`refmla.hook.extract`, which needs torch, is imported on the first
call that passes the filters.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any, Callable, Optional

from refmla.hook import kernel_probes
from refmla.hook.call import Skip
from refmla.hook.config import HookConfig, id_text
from refmla.hook.filters import before
from refmla.hook.postimport import Installation, InstallSlot
from refmla.hook.requests import TABLE, wrap_init_new
from refmla.hook.sglang_paths import (BACKEND_CLASSES, CHUNKED_PREFILL, DECODE_ONLY, FORWARD_BATCH, KV_WRITERS, MARK, MERGES,
                                      METHODS)  # fmt: skip
from refmla.hook.writer import HookState

_SLOT = InstallSlot()  # the hook's one installation in this process (refmla.hook.postimport)


def current_state() -> Optional[HookState]:
    return _SLOT.state


def _targets(cfg: HookConfig) -> dict[str, Callable[[Any], None]]:
    """module name -> what to patch in it, for the configured backends."""
    targets: dict[str, Callable[[Any], None]] = {}
    if "dsv4" in cfg.backends:
        targets[DSV4_MODULE] = _patch_dsv4_entrypoint
        targets[C4_INDEXER_MODULE] = _patch_c4_indexer
    if "dsa" in cfg.backends:
        targets[DSA_MODULE] = _patch_dsa_aiter
        targets[INDEXER_MODULE] = _patch_indexer
    for kind, switch, table in (("kvwrite", "kvwrite", KV_WRITERS), ("merge", "merge", MERGES),
                                ("chunked", "merge", CHUNKED_PREFILL)):  # fmt: skip
        if switch in cfg.backends:
            for module, entries in table.items():
                targets[module] = _chain(targets.get(module), call_patcher(_SLOT, kind, entries))
    for backend in sorted(cfg.backends - {"dsv4", "dsa", "kvwrite", "merge"}):
        for module, cls_name in BACKEND_CLASSES[backend]:
            targets[module] = _make_backend_patcher(backend, cls_name)
    if cfg.backends & {*BACKEND_CLASSES, "dsv4"}:  # the token ids of the rows the backends' captures hold
        targets[FORWARD_BATCH[0]] = _chain(targets.get(FORWARD_BATCH[0]), _patch_forward_batch)
    for backend, (modules, probes) in kernel_probes.KERNEL_PROBES.items():
        if backend in cfg.backends:
            for module in modules:  # a backend's own module may be probed too: run both patchers
                targets[module] = _chain(targets.get(module), _make_kernel_patcher(probes))
    return targets


def _chain(first: Optional[Callable[[Any], None]], then: Callable[[Any], None]) -> Callable[[Any], None]:
    if first is None:
        return then

    def both(module) -> None:
        first(module)
        then(module)

    return both


def install(cfg: HookConfig) -> HookState:
    """Install the hook for ``cfg`` in this process (idempotent; a second call keeps the first)."""
    if _SLOT.current is not None:
        return _SLOT.state
    inst = _SLOT.install(cfg.out_dir, lambda: HookState(cfg), lambda: _targets(cfg), on_error=_SLOT.fail)
    inst.state.log.info(
        "capture hook active: dir=%s layers=%s modes=%s min_seq_len=%d ranks=%s backends=%s every=%d "
        "max_files=%d max_bytes=%d partials=%s",
        cfg.out_dir, id_text(cfg.layers), ",".join(sorted(cfg.modes)),
        cfg.min_seq_len, id_text(cfg.ranks), ",".join(sorted(cfg.backends)),
        cfg.every, cfg.max_files, cfg.max_bytes, cfg.partials,
    )  # fmt: skip
    return inst.state


def uninstall() -> None:
    """Restore every patched method and kernel-module attribute and drop the import hook."""
    _SLOT.uninstall()
    TABLE.clear()


def patched_methods() -> list[str]:
    """``module.Class.method`` of every method wrapped now."""
    if _SLOT.current is None:
        return []
    return [f"{c.__module__}.{c.__qualname__}.{n}" for c, n, _ in _SLOT.current.patched]


# ---------------------------------------------------------------------------------------------
# Patchers: run by the post-import hook on each target module
# ---------------------------------------------------------------------------------------------


def _make_backend_patcher(backend: str, cls_name: str) -> Callable[[Any], None]:
    def patch(module) -> None:
        inst = _SLOT.current
        if inst is None:
            return
        cls = getattr(module, cls_name, None)
        if cls is None:
            inst.state.once(f"nocls:{module.__name__}", logging.WARNING,
                            "%s has no %s in this SGLang: %s backend not captured", module.__name__, cls_name, backend)  # fmt: skip
            return
        modes = {"decode"} & inst.state.cfg.modes if backend in DECODE_ONLY else inst.state.cfg.modes
        for mode in sorted(modes):
            _wrap_method(inst, cls, METHODS[mode], backend, mode)

    return patch


DSA_MODULE, DSA_CLASS, DSA_METHOD = "sglang.srt.layers.attention.dsa_backend", "DeepseekSparseAttnBackend", "_forward_aiter"
DSV4_MODULE = "sglang.srt.layers.attention.deepseek_v4_backend_hip_radix"
DSV4_ENTRY = "flash_mla_with_kvcache_entrypoint"


def _resolved_backend(backend: Optional[str]) -> str:
    """The sparse kernel SGLang runs for ``backend`` (on HIP its resolution; elsewhere as given)."""
    try:
        from sglang.srt.layers.attention import hip_flash_mla as h
        from sglang.srt.utils import is_hip

        if is_hip():
            return h.resolve_hip_flashmla_backend(backend if backend in h._HIP_BACKENDS else None)
    except Exception:
        pass
    return str(backend or "unknown")


def _patch_dsv4_entrypoint(module) -> None:
    """Wrap the sparse entrypoint the DeepSeek-V4 HIP radix backend calls (refmla.hook.sparse_call)."""
    inst = _SLOT.current
    original = getattr(module, DSV4_ENTRY, None)
    if inst is None or original is None or getattr(original, MARK, None) is not None:
        return
    from refmla.hook.sparse_call import wrap_entrypoint

    wrapper = wrap_entrypoint(original, current_state, _resolved_backend)
    setattr(wrapper, MARK, original)
    setattr(module, DSV4_ENTRY, wrapper)
    inst.module_attrs.append((module, DSV4_ENTRY, original))


def _patch_dsa_aiter(module) -> None:
    """Wrap the DSA backend's aiter decode path (V3.2 on ROCm; refmla.hook.dsa_call)."""
    from refmla.hook.dsa_call import wrap_forward_aiter

    _wrap_class_method(module, DSA_CLASS, DSA_METHOD, wrap_forward_aiter, "dsa", "DSA aiter decode")


def _patch_forward_batch(module) -> None:
    """Wrap ForwardBatch.init_new: the batch's requests' token ids and cache tiers (refmla.hook.requests)."""
    _wrap_class_method(module, FORWARD_BATCH[1], FORWARD_BATCH[2], wrap_init_new, "requests", "token ids of captured rows")


INDEXER_MODULE, INDEXER_CLASS, INDEXER_METHOD = "sglang.srt.layers.attention.dsa.dsa_indexer", "Indexer", "_get_topk_paged"


def _patch_indexer(module) -> None:
    """Wrap the V3.2 indexer's decode top-k (refmla.hook.indexer_call)."""
    from refmla.hook.indexer_call import wrap_get_topk_paged

    _wrap_class_method(module, INDEXER_CLASS, INDEXER_METHOD, wrap_get_topk_paged, "indexer", "the indexer")


C4_INDEXER_MODULE, C4_INDEXER_CLASS = "sglang.srt.layers.attention.dsv4.indexer", "C4IndexerBackendMixin"


def _patch_c4_indexer(module) -> None:
    """Wrap V4's C4 indexer: its two prepare steps (what they return is kept for the call) and
    forward_c4_indexer (refmla.hook.c4_indexer_call)."""
    from refmla.hook.c4_indexer_call import wrap_forward_c4_indexer, wrap_prepare

    for method in ("_forward_prepare_normal", "_forward_prepare_multi_stream"):
        _wrap_class_method(module, C4_INDEXER_CLASS, method, wrap_prepare, "c4 indexer prepare", "the C4 indexer's query")
    _wrap_class_method(module, C4_INDEXER_CLASS, "forward_c4_indexer", wrap_forward_c4_indexer, "c4 indexer",
                       "the C4 indexer")  # fmt: skip


def _wrap_class_method(module, cls_name: str, method: str, wrap: Callable, label: str, what: str) -> None:
    """``cls_name.method`` of ``module`` wrapped by ``wrap(original, current_state)`` (once; uninstall
    restores it); a release without it is said once and left alone."""
    inst = _SLOT.current
    cls = getattr(module, cls_name, None)
    original = cls.__dict__.get(method) if cls is not None else None
    if inst is None:
        return
    if original is None:
        inst.state.once(f"no{label}:{module.__name__}", logging.WARNING, "%s has no %s.%s in this SGLang: %s not "
                        "captured", module.__name__, cls_name, method, what)  # fmt: skip
        return
    if getattr(original, MARK, None) is not None:
        return
    wrapper = wrap(original, current_state)
    setattr(wrapper, MARK, original)
    setattr(cls, method, wrapper)
    inst.patched.append((cls, method, original))
    inst.state.log.info("wrapped %s.%s.%s (%s)", module.__name__, cls_name, method, label)


def call_patcher(slot: InstallSlot, kind: str, entries) -> Callable[[Any], None]:
    """Wrap a KV writer, a state merge or the chunked-prefix prefill core (kind "kvwrite" / "merge" /
    "chunked"): each (class or None, name,
    reader) of ``entries`` in the module, a method of the class or a module function; uninstall
    restores it. The wrappers (refmla.hook.kvwrite_call, merge_call) import torch: loaded here."""

    def patch(module) -> None:
        inst = slot.current
        if inst is None:
            return
        for cls_name, name, reader in entries:
            owner = getattr(module, cls_name, None) if cls_name else module
            original = (owner.__dict__.get(name) if cls_name else getattr(module, name, None)) if owner is not None else None
            if original is None or getattr(original, MARK, None) is not None:
                continue
            from refmla.hook.merge_call import wrapper_for

            wrapper = wrapper_for(kind, reader, original, name, lambda: slot.state)
            setattr(wrapper, MARK, original)
            setattr(owner, name, wrapper)
            (inst.patched if cls_name else inst.module_attrs).append((owner, name, original))
            inst.state.log.info("wrapped %s.%s (%s)", module.__name__, f"{cls_name}.{name}" if cls_name else name, kind)

    return patch


def _make_kernel_patcher(probes: dict[str, Callable[[Callable], Callable]]) -> Callable[[Any], None]:
    """Probe a kernel module (see :mod:`refmla.hook.kernel_probes`); uninstall restores it."""

    def patch(module) -> None:
        inst = _SLOT.current
        if inst is None:
            return
        kernel_probes.probe_module(module, probes, lambda mod, attr, fn: inst.module_attrs.append((mod, attr, fn)))

    return patch


def _wrap_method(inst: Installation, cls: type, name: str, backend: str, mode: str) -> None:
    original = cls.__dict__.get(name)
    if original is None or getattr(original, MARK, None) is not None:
        return
    try:
        params = list(inspect.signature(original).parameters)
    except (TypeError, ValueError):
        params = []
    needed = ("q", "layer", "forward_batch")
    if params[:1] != ["self"] or any(p not in params for p in needed):
        inst.state.once(f"sig:{cls.__qualname__}.{name}", logging.WARNING,
                        "%s.%s has an unknown signature %s: not captured", cls.__qualname__, name, params)  # fmt: skip
        return
    wrapper = _make_wrapper(original, _argument_reader(params), backend, mode)
    wrapper.__name__ = getattr(original, "__name__", name)
    wrapper.__qualname__ = getattr(original, "__qualname__", name)
    wrapper.__doc__ = getattr(original, "__doc__", None)
    wrapper.__wrapped__ = original  # type: ignore[attr-defined]
    setattr(wrapper, MARK, original)
    setattr(cls, name, wrapper)
    inst.patched.append((cls, name, original))
    inst.state.log.info("wrapped %s.%s.%s (%s)", cls.__module__, cls.__qualname__, name, backend)


# ---------------------------------------------------------------------------------------------
# The wrapper
# ---------------------------------------------------------------------------------------------


def _argument_reader(params: list[str]) -> Callable[..., Any]:
    """``arg(args, kwargs, name, default)``: an argument of a call by its parameter name."""
    pos = {p: i - 1 for i, p in enumerate(params) if i > 0}  # argument name -> index in *args

    def arg(args: tuple, kwargs: dict, pname: str, default: Any = None) -> Any:
        if pname in kwargs:
            return kwargs[pname]
        i = pos.get(pname)
        return args[i] if i is not None and i < len(args) else default

    return arg


def _make_wrapper(original: Callable, arg: Callable[..., Any], backend: str, mode: str) -> Callable:
    def wrapper(self, *args, **kwargs):
        inst_now = _SLOT.current
        state = inst_now.state if inst_now is not None else None
        if state is None or not state.active:
            return original(self, *args, **kwargs)
        call = None
        try:
            call = before(state, backend, mode, arg(args, kwargs, "layer"), arg(args, kwargs, "forward_batch"))
        except Exception as e:
            state.fail(e)
        if call is None:
            return original(self, *args, **kwargs)
        kernel_probes.start_notes()
        result = original(self, *args, **kwargs)
        try:
            from refmla.hook.extract import after  # the torch side (see the module docstring)

            call.q = arg(args, kwargs, "q")
            call.k = arg(args, kwargs, "k")
            call.q_rope = arg(args, kwargs, "q_rope")
            call.llama_4_scaling = arg(args, kwargs, "llama_4_scaling")
            call.sinks = arg(args, kwargs, "sinks")
            call.kernel_notes = kernel_probes.take_notes()
            after(state, call, self, result)
        except Skip as s:
            state.skip(str(s))
        except Exception as e:
            state.fail(e)
        finally:
            kernel_probes.clear_notes()
        return result

    return wrapper
