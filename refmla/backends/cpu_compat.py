"""Importing SGLang on a CPU-only machine whose torchvision came from PyPI.

PyPI's Linux torchvision wheels are CUDA builds. Next to a CPU torch their ``_C`` extension
cannot load (it links ``libtorch_cuda.so``); torchvision then still imports its
``_meta_registrations``, which registers a fake kernel for ``torchvision::nms`` without checking
that the operator exists, and ``import torchvision`` raises
``RuntimeError: operator torchvision::nms does not exist``. ``import sglang`` reaches torchvision
through transformers' image processors (0.5.23: ``sglang/__init__`` ->
``hf_transformers_patches``), and SGLang's attention backends import ``torchvision.transforms``
directly, so on such a machine nothing of SGLang imports.

:func:`torchvision_cpu_shim` defines the two operator *schemas* (no kernels) when, and only when,
the real extension cannot be loaded, which is all torchvision needs to import. Nothing in refmla
runs a torchvision operator. Call it before the first import of sglang, transformers or
torchvision; it is a no-op where torchvision's own ops load (any GPU machine with a matching
build) or where torchvision is absent.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import sys

_lib = None  # the schema library; must stay alive or torch drops the definitions


def torchvision_cpu_shim() -> str:
    """Make a CUDA-built torchvision importable next to a CPU torch. Returns what it did."""
    global _lib
    if _lib is not None:
        return "schemas defined (earlier)"
    if "torchvision" in sys.modules:
        return "torchvision already imported: nothing done"
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return "torchvision not installed: nothing to do"
    import torch

    libs = [p for d in spec.submodule_search_locations for p in glob.glob(os.path.join(d, "_C*.so"))]
    if libs:
        try:
            torch.ops.load_library(libs[0])
            return "torchvision's own extension loads: nothing to do"
        except (OSError, RuntimeError):
            pass
    lib = torch.library.Library("torchvision", "DEF")
    lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _lib = lib
    return "torchvision extension does not load here (CUDA build?): nms/qnms schemas defined"
