"""Finding a kernel across releases and calling it by keyword: shared by every kernel backend.

Kernel modules move and signatures grow between SGLang and aiter releases, so refmla never calls
a kernel positionally: it imports the first module path that has the function and builds the
keyword arguments from ``inspect.signature``.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from typing import Any, Callable, Mapping, Optional, Sequence


class KernelNotFound(RuntimeError):
    """No candidate module path has the function; the message says what went wrong at each."""


class KernelSignatureError(TypeError):
    """The kernel wants something refmla cannot give, or lacks a parameter the math needs."""


def find_function(module_paths: Sequence[str], attr: str, what: str) -> tuple[Callable, str]:
    """(function, module path) of the first module in ``module_paths`` that defines ``attr``.

    Raises KernelNotFound naming what went wrong at each path, the first real cause first: a path
    whose import fails the same way as an earlier one says so instead of repeating it.
    """
    tried, causes = [], []
    for name in module_paths:
        try:
            mod = _import_cleanly(name)
        except ModuleNotFoundError as e:
            missing_path = e.name and name.startswith(e.name)  # else one of its imports is missing
            cause = "not in this release" if missing_path else f"import failed: {e}"
        except Exception as e:
            cause = f"import failed: {type(e).__name__}: {e}"
        else:
            fn = getattr(mod, attr, None)
            if fn is not None:
                return fn, name
            cause = f"has no {attr}"
        repeated = cause.startswith("import failed") and cause in causes
        tried.append(f"{name}: " + ("import failed the same way" if repeated else cause))
        causes.append(cause)
    raise KernelNotFound(f"{what} not found: " + "; ".join(tried))


def first_module_with(module_paths: Sequence[str], attrs: Sequence[str]) -> tuple[Optional[Any], str, list[str]]:
    """(module, its path, why each earlier path was not) of the first path whose module imports and
    has every name of ``attrs`` callable; (None, "", why each was not) when none does."""
    tried = []
    for name in module_paths:
        try:
            mod = importlib.import_module(name)
        except Exception as e:
            tried.append(f"{name}: {type(e).__name__}: {e}")
            continue
        if all(callable(getattr(mod, a, None)) for a in attrs):
            return mod, name, tried
        tried.append(f"{name}: no {' / '.join(attrs)}")
    return None, "", tried


def _import_cleanly(name: str):
    """importlib.import_module(name), with no half-imported modules of its package before or after.

    When a package's ``__init__`` fails (say a third-party module it imports is missing), Python
    removes the package but keeps the submodules it had already imported. Such orphans, left by
    this import or by an earlier ``import pkg`` anywhere in the process, break the next import from
    the package with a side effect (``KeyError: 'pkg'``: a namespace subpackage looking up its
    missing parent) instead of the real cause. They cannot be used, so they are dropped.
    """
    root = name.partition(".")[0]
    _drop_orphans(root)
    try:
        return importlib.import_module(name)
    except Exception:
        _drop_orphans(root)
        raise


def _drop_orphans(root: str) -> None:
    """Remove ``root``'s submodules from sys.modules when ``root`` itself is not imported."""
    if root not in sys.modules:
        for orphan in [m for m in sys.modules if m.startswith(root + ".")]:
            del sys.modules[orphan]


# values that change the result: a kernel without a parameter for them cannot be used when they
# differ from this neutral value
MATH_NEUTRAL = {"k_scale": 1.0, "v_scale": 1.0}


def unreadable_signature(fn: Callable) -> Optional[str]:
    """Why ``fn``'s parameters cannot be read, or None when they can: a wrapper ``def f(*args,
    **kwargs)`` without ``functools.wraps`` (a profiler's, a monkeypatch's) names none of them
    (``inspect.signature`` follows ``__wrapped__`` where the wrapper sets it)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError) as e:
        return f"its signature cannot be read ({e})"
    if params and all(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params.values()):
        return f"it takes ({', '.join(str(p) for p in params.values())}): a wrapper that hides the kernel's parameters"
    return None


def positional_for(fn: Callable, values: Mapping[str, Any], documented: Sequence[str]) -> list[Any]:
    """The arguments of a kernel whose signature cannot be read (:func:`unreadable_signature`), in
    the engine's documented parameter order ``documented`` (every name a key of ``values``)."""
    missing = [n for n in documented if n not in values]
    if missing:
        raise KernelSignatureError(f"{_name(fn)}: no value for documented parameter(s) {', '.join(missing)}")
    return [values[n] for n in documented]


def _name(fn: Callable) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', getattr(fn, '__name__', repr(fn)))}"


def kwargs_for(
    fn: Callable, values: Mapping[str, Any], aliases: Optional[Mapping[str, str]] = None
) -> dict[str, Any]:
    """Keyword arguments for ``fn`` from ``values`` by its signature.

    ``aliases`` maps a parameter name some release uses to the key in ``values``. Raises
    KernelSignatureError when ``fn`` requires a parameter refmla does not fill, when a value
    that changes the math (k_scale / v_scale other than 1) has no parameter to go to, or when its
    parameters cannot be read (a wrapper without ``functools.wraps``: an adapter that knows the
    engine's documented order calls it by :func:`positional_for` instead).
    """
    aliases = aliases or {}
    why = unreadable_signature(fn)
    if why:
        raise KernelSignatureError(f"{_name(fn)}: {why}; refmla cannot tell which argument goes where, "
                                   "so it does not call it (wrap the kernel with functools.wraps)")  # fmt: skip
    params = inspect.signature(fn).parameters
    kwargs = {}
    for name, p in params.items():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        key = aliases.get(name, name)
        if key in values:
            kwargs[name] = values[key]
        elif p.default is p.empty:
            raise KernelSignatureError(
                f"{fn.__module__}.{fn.__name__} requires parameter {name!r}, unknown to this refmla "
                f"(it fills {', '.join(values)})"
            )
    taken = {aliases.get(n, n) for n in params}
    for name, neutral in MATH_NEUTRAL.items():
        if name in values and name not in taken and float(values[name]) != neutral:
            raise KernelSignatureError(
                f"{fn.__module__}.{fn.__name__} has no {name!r} parameter; cannot apply {name}={values[name]}"
            )
    return kwargs
