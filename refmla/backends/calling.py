"""Finding a kernel across releases and calling it by keyword: shared by every kernel backend.

Kernel modules move and signatures grow between SGLang and aiter releases, so refmla never calls
a kernel positionally: it imports the first module path that has the function and builds the
keyword arguments from ``inspect.signature``.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any, Callable, Mapping, Optional, Sequence


class KernelNotFound(RuntimeError):
    """No candidate module path has the function; the message says what went wrong at each."""


class KernelSignatureError(TypeError):
    """The kernel wants something refmla cannot give, or lacks a parameter the math needs."""


def find_function(module_paths: Sequence[str], attr: str, what: str) -> tuple[Callable, str]:
    """(function, module path) of the first module in ``module_paths`` that defines ``attr``."""
    tried = []
    for name in module_paths:
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as e:
            missing_path = e.name and name.startswith(e.name)  # else one of its imports is missing
            tried.append(f"{name}: not in this release" if missing_path else f"{name}: import failed: {e}")
            continue
        except Exception as e:
            tried.append(f"{name}: import failed: {type(e).__name__}: {e}")
            continue
        fn = getattr(mod, attr, None)
        if fn is None:
            tried.append(f"{name}: has no {attr}")
            continue
        return fn, name
    raise KernelNotFound(f"{what} not found: " + "; ".join(tried))


# values that change the result: a kernel without a parameter for them cannot be used when they
# differ from this neutral value
MATH_NEUTRAL = {"k_scale": 1.0, "v_scale": 1.0}


def kwargs_for(
    fn: Callable, values: Mapping[str, Any], aliases: Optional[Mapping[str, str]] = None
) -> dict[str, Any]:
    """Keyword arguments for ``fn`` from ``values`` by its signature.

    ``aliases`` maps a parameter name some release uses to the key in ``values``. Raises
    KernelSignatureError when ``fn`` requires a parameter refmla does not fill, or when a value
    that changes the math (k_scale / v_scale other than 1) has no parameter to go to.
    """
    aliases = aliases or {}
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
