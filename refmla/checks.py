"""Metadata forensics, run by ``refmla inspect`` and before every replay.

Structural problems were already raised by :func:`refmla.capture.validate` (exit 2); here are
the facts a kernel engineer looks for next. Errors make a capture invalid; warnings are findings.
"""

from __future__ import annotations

import torch

from refmla.capture import Capture


def check_capture(cap: Capture) -> dict:
    """{"ok": bool, "errors": [...], "warnings": [...]} for one capture."""
    errors: list[str] = []
    warnings: list[str] = list(cap.warnings)
    warnings += repeated_slots(cap)
    return {"ok": not errors, "errors": errors, "warnings": warnings}


def repeated_slots(cap: Capture) -> list[str]:
    """A slot listed twice within one request means two positions read the same KV row."""
    found = []
    for b in range(cap.batch_size):
        idx = cap.kv_indices[int(cap.kv_indptr[b]) : int(cap.kv_indptr[b + 1])].long()
        uniq, counts = torch.unique(idx, return_counts=True)
        if bool((counts > 1).any()):
            slot = int(uniq[counts > 1][0])
            first = int(torch.nonzero(idx == slot)[1])
            found.append(f"request {b}: slot {slot} appears {int(counts.max())} times (again at position {first})")
    return found
