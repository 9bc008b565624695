"""`refmla regions` as text: every registered buffer's size and band, then the verdict line."""

from __future__ import annotations

from refmla.region_check import BAND_STATUS, RegionCheck, measured_for, size_text

BAND_TEXT = {"fails": "FAILS (at / past the smallest measured to fail)",
             "unmeasured": "UNMEASURED (between the largest registered and the smallest failed)",
             "registers": "registers (over SGLang's clamp, at most the largest measured to register)",
             "under_clamp": "under SGLang's clamp (registers)"}  # fmt: skip


def render_regions(check: RegionCheck) -> str:
    """One line per kind of buffer (alike ones counted), then the deciding sentence."""
    lines = []
    measured = measured_for(check.transfer_backend)  # else no figure is compared with (they are MORI's)
    for b in check.buffers:
        count = f" x{b.count}" if b.count > 1 else ""
        band = BAND_TEXT[b.band] if measured else f"UNMEASURED (nothing is measured for {check.transfer_backend})"
        clamp = "clamp" if measured else "under MORI, SGLang's clamp"
        lines.append(f"  {b.name}{count}: {size_text(b.region_bytes, check.limit_bytes)}, "
                     f"{b.bytes_per_token:g} B/token -> {band}; {clamp} -> {b.clamp_tokens} tokens")  # fmt: skip
    head = {"finding": "FINDING", "warning": "WARNING"}.get(check.status, BAND_STATUS.get(check.band, check.status))
    return "\n".join([f"regions  {head}: {check.message}", *lines])


__all__ = ["render_regions"]
