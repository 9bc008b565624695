"""The plain column table every command prints, and how numbers are shown in it."""

from __future__ import annotations

from typing import Any

from refmla.util import printable


def fmt(x: Any) -> str:
    """None -> "-", floats to 3 significant digits, anything else as str."""
    if x is None:
        return "-"
    if isinstance(x, float):
        return "0" if x == 0 else f"{x:.3g}"
    return str(x)


def table(rows: list[list[str]], header: list[str]) -> str:
    rows = [[printable(c) for c in r] for r in rows]  # cells hold rids, names, paths from files
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]

    def line(r: list) -> str:
        return "  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip()

    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


def clip(text: str, width: int) -> str:
    """``text`` cut to ``width`` characters, ending in "..." when cut."""
    return text if len(text) < width else text[: width - 3] + "..."
