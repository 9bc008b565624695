"""`refmla synth OUT --preset deepseek-v4-flash-tp8 [--fault NAME] [--layer N]`: write a synthetic sparse
decode capture, production's output planted by refmla.sparse.faults."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Optional

from refmla.sparse.faults import APPLIES, FAULTS, planted_output
from refmla.sparse.validation import write_sparse
from refmla.sparse.presets import for_layer, sparse_preset
from refmla.sparse.synth import build_case


def synth_sparse(out: Any, preset_name: str, fault: Optional[str] = None, seed: Optional[int] = None,
                 layer: Optional[int] = None) -> dict:  # fmt: skip
    """Write the capture; returns what was planted ({"fault": name or "none", ...}). ``layer``: that
    layer of the model (its ratio and extra cache from the model's per-layer list, named in meta)."""
    p = sparse_preset(preset_name)
    if layer is not None:
        p = for_layer(p, layer)
    if seed is not None:
        p = dataclasses.replace(p, seed=seed)
    fault = None if fault in (None, "none") else fault
    if fault is not None and fault not in FAULTS:
        raise ValueError(f"unknown sparse fault {fault!r}; choose from none, {', '.join(FAULTS)}")
    case = build_case(p)
    if fault is not None and not APPLIES.get(fault, lambda c: True)(case):
        raise ValueError(f"fault {fault!r} does not apply to preset {p.name}")
    o, lse = planted_output(case, fault)
    meta = case.meta()
    if fault:
        meta["synth_fault"] = fault
    write_sparse(Path(out), {**case.tensors(), "out": o, "lse": lse}, meta)
    return {"fault": fault or "none", **({"detail": FAULTS[fault]} if fault else {})}


__all__ = ["synth_sparse"]
