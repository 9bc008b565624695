"""The names a kernel outside refmla goes by (docs/own-kernel.md), resolved to a PluginBackend:

    mine                      registered in this process (refmla.api.replay(..., backends={"mine": fn}))
    my_kernel                 an entry point of the group ``refmla.backends`` of an installed package
                              (``[project.entry-points."refmla.backends"] my_kernel = "pkg.mod:fn"``)
    pkg.module:fn             a module on the Python path, and the callable in it (no install)
    path/to/file.py:fn        a Python file, and the callable in it

Entry points join the default sets (replay, sweep, goldens, doctor); the other forms run when named.
A ``module:fn`` that cannot be imported, or names no callable of the interface, is an
InterfaceError (a usage error: exit 2); an entry point that cannot be loaded is that backend
unavailable, with the reason, as a missing optional package is for refmla's own backends.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any, Callable

from refmla.backends.plugin import PluginBackend
from refmla.kernel import InterfaceError
from refmla.util import error_text

GROUP = "refmla.backends"
_REGISTERED: dict[str, Callable] = {}


class EntryPointBroken(Exception):
    """An installed entry point that cannot be loaded: its backend is unavailable with this reason."""


def register(name: str, fn: Callable) -> None:
    """``fn`` as the backend ``name`` in this process (and its forked kernel processes)."""
    PluginBackend(name, fn, f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', fn)}")  # the signature check
    _REGISTERED[name] = fn


def is_registered(name: str) -> bool:
    return name in _REGISTERED


def unregister(name: str) -> None:
    _REGISTERED.pop(name, None)


@functools.lru_cache(maxsize=1)
def _entry_points() -> dict[str, Any]:
    from importlib.metadata import entry_points

    try:
        found = entry_points(group=GROUP)
    except Exception:  # broken metadata of some other package: no plugins, never a crash
        return {}
    return {ep.name: ep for ep in found}


def entry_point_names() -> tuple[str, ...]:
    """The installed packages' kernels (group ``refmla.backends``), sorted."""
    return tuple(sorted(_entry_points()))


def entry_point_of(name: str) -> tuple[str, str]:
    """(distribution, ``module:attr``) of the entry point ``name`` (doctor's engine and kernel columns)."""
    ep = _entry_points()[name]
    dist = getattr(getattr(ep, "dist", None), "name", None) or "?"
    return dist, ep.value


def refresh() -> None:
    """Read the installed entry points again (after an install in this process)."""
    _entry_points.cache_clear()


def is_spec(name: str) -> bool:
    """``module:attr`` or ``file.py:attr``: a kernel named where it lives."""
    where, sep, attr = str(name).rpartition(":")
    return bool(sep and where and attr)


def known(name: str) -> bool:
    """Whether ``name`` names a kernel outside refmla (registered, an entry point, a ``module:fn``)."""
    return name in _REGISTERED or name in _entry_points() or is_spec(name)


class Choices(tuple):
    """argparse ``choices`` of a --backend flag: the names listed, and any kernel outside refmla
    (help and errors list the names; ``module:fn`` is said in the flag's help)."""

    def __contains__(self, name: object) -> bool:
        return tuple.__contains__(self, name) or (isinstance(name, str) and known(name))


def load(name: str) -> PluginBackend:
    """The backend ``name`` names. KeyError: not such a name; InterfaceError: a ``module:fn`` that
    cannot be loaded or is not the interface; EntryPointBroken: an entry point that cannot be loaded."""
    if name in _REGISTERED:
        fn = _REGISTERED[name]
        return PluginBackend(name, fn, f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', fn)} (registered)")
    if name in _entry_points():
        ep = _entry_points()[name]
        try:
            fn = ep.load()
        except Exception as e:
            raise EntryPointBroken(f"entry point {ep.value} cannot be loaded: {error_text(e)}") from e
        return _Named(name, fn, ep.value)
    if is_spec(name):
        return _Named(name, _from_spec(name), name)
    raise KeyError(name)


class _Named(PluginBackend):
    """A backend found by a name any process can resolve again: pickled as that name (a spawned
    kernel process, a sweep worker, imports it itself)."""

    def __reduce__(self):
        return (load, (self.name,))


def _from_spec(spec: str) -> Callable:
    where, _, attr = spec.rpartition(":")
    try:
        if where.endswith(".py") or "/" in where:
            module = _from_file(Path(where))
        else:
            module = importlib.import_module(where)
    except InterfaceError:
        raise
    except Exception as e:
        raise InterfaceError(f"--backend {spec}: cannot import {where}: {error_text(e)}") from None
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise InterfaceError(f"--backend {spec}: {where} has no {attr!r}")
        obj = getattr(obj, part)
    return obj


def _from_file(path: Path):
    """The module of a Python file, imported once per process under a name of its own."""
    if not path.is_file():
        raise InterfaceError(f"--backend {path}: no such file")
    name = "refmla_kernel_" + "".join(c if c.isalnum() else "_" for c in str(path.resolve()))
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise InterfaceError(f"--backend {path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


__all__ = ["GROUP", "Choices", "EntryPointBroken", "entry_point_names", "entry_point_of", "is_registered", "is_spec", "known", "load", "refresh",
           "register", "unregister"]  # fmt: skip
