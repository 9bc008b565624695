"""refmla capture: installs the capture hook at interpreter start-up when REFMLA_CAPTURE_DIR is set.

``refmla capture run`` puts this folder first on ``PYTHONPATH``, so every Python process started
under it (SGLang's scheduler and TP workers included) runs this file at start-up. With
``REFMLA_CAPTURE_DIR`` unset it does nothing and imports nothing. Afterwards it runs the
``sitecustomize`` that this one shadows, if there is one further down ``sys.path``.

Deliberately not a package module: no ``__init__.py`` in this folder.
"""

import os
import sys


def _refmla_boot() -> None:
    if not os.environ.get("REFMLA_CAPTURE_DIR", "").strip():
        return
    try:
        import refmla.hook  # noqa: F401  (installs the hook because REFMLA_CAPTURE_DIR is set)
    except Exception as e:  # never keep an interpreter from starting
        sys.stderr.write(f"[refmla.hook pid={os.getpid()}] capture hook not installed: {type(e).__name__}: {e}\n")


def _refmla_chain() -> None:
    """Run the sitecustomize this file hides (e.g. a distribution's), as Python would have."""
    try:
        import importlib.machinery
        import importlib.util

        here = os.path.dirname(os.path.abspath(__file__))
        rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
        spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
        if spec is None or spec.loader is None or os.path.abspath(spec.origin or "") == os.path.abspath(__file__):
            return
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    except Exception as e:
        sys.stderr.write(f"[refmla.hook pid={os.getpid()}] the shadowed sitecustomize failed: {type(e).__name__}: {e}\n")


_refmla_boot()
_refmla_chain()
