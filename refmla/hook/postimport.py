"""A ``sys.meta_path`` post-import hook: run a callback right after a target module has executed.

This is how the hook patches SGLang's classes without importing SGLang itself: the finder wraps
the loader of each target module, and the wrapped loader calls back once the module's code has
run (or :meth:`PostImportFinder.run_callback` is called at once for a module already imported).

:class:`InstallSlot` is the one installation of a hook in a process, shared by the SGLang hook
(:mod:`refmla.hook.patching`) and the vLLM hook (:mod:`refmla.hook.vllm_patch`): install once
(a second install keeps the first), patch through a finder, restore every original on uninstall.
"""

from __future__ import annotations

import importlib.abc
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Optional


class PostImportFinder(importlib.abc.MetaPathFinder):
    """Runs a callback right after one of the target modules has been executed.

    For any other module ``find_spec`` returns None after one dict lookup, so the cost for the
    rest of the process is nil. The callback is guarded: an exception in it goes to ``on_error``
    (which disables the hook) and never into the import of SGLang.
    """

    def __init__(self, targets: dict[str, Callable[[Any], None]], on_error: Callable[[Exception], None]):
        self.targets = dict(targets)
        self.on_error = on_error
        self._busy: set[str] = set()
        self._done: set[str] = set()

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in self.targets or fullname in self._busy:
            return None
        self._busy.add(fullname)
        try:
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
            else:
                return None
        finally:
            self._busy.discard(fullname)
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = CallbackLoader(spec.loader, lambda mod: self.run_callback(fullname, mod))
        return spec

    def run_callback(self, fullname: str, module: Any) -> None:
        if fullname in self._done:
            return
        self._done.add(fullname)
        try:
            self.targets[fullname](module)
        except Exception as e:  # never let the hook break an import of SGLang
            self.on_error(e)


class CallbackLoader(importlib.abc.Loader):
    """Delegates to the real loader, then calls back with the executed module."""

    def __init__(self, inner, callback):
        self._inner, self._callback = inner, callback

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        self._inner.exec_module(module)
        self._callback(module)

    def __getattr__(self, name):  # get_source, get_code, is_package, get_resource_reader, ...
        return getattr(self._inner, name)


def activate(targets: dict[str, Callable[[Any], None]], on_error: Callable[[Exception], None]) -> PostImportFinder:
    """A finder for ``targets`` first on ``sys.meta_path``, with the targets already imported patched now."""
    finder = PostImportFinder(targets, on_error=on_error)
    sys.meta_path.insert(0, finder)
    for module in targets:
        mod = sys.modules.get(module)
        if mod is not None:
            finder.run_callback(module, mod)
    return finder


@dataclass
class Installation:
    """One hook installed in this process: its state, its import finder, and what it replaced."""

    state: Any  # refmla.hook.writer.HookState
    finder: Optional[PostImportFinder] = None
    patched: list = field(default_factory=list)  # (class, method, original) wrapped methods
    module_attrs: list = field(default_factory=list)  # (module, attribute, original) replaced functions

    def restore(self) -> None:
        """Drop the finder and put every original back, the latest patch first."""
        if self.finder is not None and self.finder in sys.meta_path:
            sys.meta_path.remove(self.finder)
        for owner, name, original in reversed(self.patched):
            setattr(owner, name, original)
        for owner, name, original in reversed(self.module_attrs):
            setattr(owner, name, original)


class InstallSlot:
    """The (at most one) :class:`Installation` of a hook in this process."""

    def __init__(self) -> None:
        self.current: Optional[Installation] = None

    def install(self, out_dir: str, make_state: Callable[[], Any],
                targets: Callable[[], dict[str, Callable[[Any], None]]],
                on_error: Callable[[Exception], None]) -> Installation:  # fmt: skip
        """Install once: the output folder, the state, then the finder (``targets()`` is built once
        the slot holds the installation, so patchers that run at once already see it)."""
        if self.current is not None:
            return self.current
        os.makedirs(out_dir, exist_ok=True)
        inst = Installation(state=make_state())
        self.current = inst
        inst.finder = activate(targets(), on_error=on_error)  # modules already imported are patched now
        return inst

    def uninstall(self) -> None:
        inst, self.current = self.current, None
        if inst is not None:
            inst.restore()

    def fail(self, e: Exception) -> None:
        """A patcher's exception: disable the installed hook (logged once); never raises."""
        if self.current is not None:
            self.current.state.fail(e)

    @property
    def state(self) -> Any:
        return self.current.state if self.current is not None else None
