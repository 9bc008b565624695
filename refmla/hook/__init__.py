"""Capture from a live SGLang server: an env-gated hook on the Triton and aiter MLA backends.

Two ways to switch it on (see ``docs/capture.md``):

* ``refmla capture run --out DIR -- python -m sglang.launch_server ...`` runs the command with
  the hook active in it and in every Python process it spawns (a ``sitecustomize`` on
  ``PYTHONPATH``);
* without the wrapper: set ``REFMLA_CAPTURE_DIR=DIR`` and ``import refmla.hook`` once in the
  server process before it builds its attention backend. Importing this package installs the
  hook when (and only when) ``REFMLA_CAPTURE_DIR`` is set; :func:`install` does it explicitly.

With ``REFMLA_CAPTURE_DIR`` unset nothing is patched and nothing of torch or SGLang is imported:
the hook costs nothing. The other ``REFMLA_CAPTURE_*`` variables are described in
:mod:`refmla.hook.config`.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

from refmla.hook.config import ENV_DIR, ConfigError, HookConfig

__all__ = ["ENV_DIR", "ConfigError", "HookConfig", "install", "uninstall", "installed", "status"]


def install(cfg: Optional[HookConfig] = None, environ: Optional[Mapping[str, str]] = None) -> bool:
    """Install the hook in this process. Returns True when it is active.

    ``cfg`` defaults to :meth:`HookConfig.from_env`; with ``REFMLA_CAPTURE_DIR`` unset nothing
    happens and False is returned. A configuration error is logged (never raised) and leaves the
    hook off: a typo in a variable must not keep the server from starting.
    """
    from refmla.hook.writer import get_logger

    if cfg is None:
        try:
            cfg = HookConfig.from_env(environ)
        except ConfigError as e:
            get_logger().error("capture hook not installed: %s", e)
            return False
        if cfg is None:
            return False
    try:
        from refmla.hook import sglang_patch

        sglang_patch.install(cfg)
    except Exception as e:  # never break the process that imported us
        get_logger().error("capture hook not installed: %s: %s", type(e).__name__, e)
        return False
    return True


def uninstall() -> None:
    """Remove the hook: originals restored, import hook dropped (for tests and notebooks)."""
    import sys

    mod = sys.modules.get("refmla.hook.sglang_patch")
    if mod is not None:
        mod.uninstall()


def installed() -> bool:
    import sys

    mod = sys.modules.get("refmla.hook.sglang_patch")
    return bool(mod is not None and mod.current_state() is not None)


def status() -> Optional[dict[str, Any]]:
    """What this process's hook did so far (files, bytes, skips, why stopped), or None if off."""
    import sys

    mod = sys.modules.get("refmla.hook.sglang_patch")
    state = mod.current_state() if mod is not None else None
    if state is None:
        return None
    return {**state.summary(), "patched": mod.patched_methods()}


def _auto_install() -> None:
    import os

    if os.environ.get(ENV_DIR, "").strip():
        install()


_auto_install()
