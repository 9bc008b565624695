"""What every command shares: exit codes, usage errors, capture paths, JSON on stdout."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

from refmla.util import json_safe

EXIT_OK, EXIT_DIVERGED, EXIT_INVALID = 0, 1, 2


class UsageError(Exception):
    """Bad input that is not a capture file (a path, an option): exit 2 with one line."""


def expand_captures(paths: Sequence[str]) -> list[str]:
    """Files as given; directories -> every *.safetensors regular file inside, sorted. Missing paths
    stay (they are reported as invalid captures)."""
    out: list[str] = []
    for p in paths:
        path = Path(p)
        if path.is_dir():
            found = sorted(str(f) for f in path.rglob("*.safetensors") if f.is_file())
            if not found:
                raise UsageError(f"{p}: directory holds no *.safetensors captures")
            out += found
        else:
            out.append(p)
    return out


def single_file(args_paths: Sequence[str]) -> bool:
    """One path given, and it is not a directory: the JSON is one object, not an array."""
    return len(args_paths) == 1 and not Path(args_paths[0]).is_dir()


def print_json(obj: Any) -> None:
    """Typed results (``to_json``) or plain data as one JSON document on stdout, NaN/Inf as null."""
    print(json.dumps(json_safe(obj), indent=2, allow_nan=False))


def need_matplotlib() -> None:
    """--plot without matplotlib: one line, exit 2, before any work."""
    try:
        import refmla.plots  # noqa: F401
    except ImportError as e:
        raise UsageError(str(e).splitlines()[0]) from None

