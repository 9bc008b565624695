"""What every command shares: exit codes, usage errors, capture paths, JSON on stdout."""

from __future__ import annotations

import argparse
import json
import os
import stat
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

from refmla.api import unrun_backends
from refmla.signals import signals_deferred
from refmla.util import first_line, json_safe, printable

EXIT_OK, EXIT_DIVERGED, EXIT_INVALID = 0, 1, 2
EXIT_NOT_RUN = 3  # a backend named with --backend did not run (skipped) and --allow-skip was not given
PRIORITY = (EXIT_INVALID, EXIT_DIVERGED, EXIT_NOT_RUN, EXIT_OK)  # the worst first: 2 > 1 > 3 > 0


def worst_exit(*codes: int) -> int:
    """The worst of several exit codes in PRIORITY's order (3 is worse than 0, better than a finding)."""
    return min(codes, key=PRIORITY.index, default=EXIT_OK)


class UsageError(Exception):
    """Bad input that is not a capture file (a path, an option): exit 2 with one line."""


def is_dir(path: Any) -> bool:
    """os.path.isdir that never raises (a name too long, a permission denied: not a directory)."""
    try:
        return stat.S_ISDIR(os.stat(path).st_mode)
    except (OSError, ValueError):
        return False


def expand_captures(paths: Sequence[str]) -> list[str]:
    """Files as given; directories -> every ``*.safetensors`` entry inside that is not a directory,
    sorted: a FIFO, a device or a dangling link named so is listed (and reported invalid, never
    opened), not skipped. Missing paths stay (they are reported as invalid captures)."""
    out: list[str] = []
    for p in paths:
        if is_dir(p):
            found = sorted(str(f) for f in Path(p).rglob("*.safetensors") if not is_dir(f))
            if not found:
                raise UsageError(f"{p}: directory holds no *.safetensors captures")
            out += found
        else:
            out.append(p)
    return out


def single_file(args_paths: Sequence[str]) -> bool:
    """One path given, and it is not a directory: the JSON is one object, not an array."""
    return len(args_paths) == 1 and not is_dir(args_paths[0])


def output_path(text: str) -> str:
    """argparse type of every output a command names (a folder or a file): an empty or blank path
    would resolve to the working directory, a NUL cannot be a path: both are usage errors."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"{text!r} is empty: name the output explicitly ('.' for the working directory)")
    if "\0" in text:
        raise argparse.ArgumentTypeError("a path cannot hold a NUL byte")
    return text


def describe_inputs(args: argparse.Namespace) -> str:
    """The files a command was given, for the one line of an unexpected error: "F", "F (and 3 more)"."""
    paths: list[str] = []
    for name in ("captures", "prefill", "decode", "out", "path"):
        value = getattr(args, name, None)
        paths += [str(v) for v in value] if isinstance(value, (list, tuple)) else [str(value)] if value else []
    if not paths:
        return ""
    return paths[0] + (f" (and {len(paths) - 1} more)" if len(paths) > 1 else "")


def report_invalid(capture: str, error: Optional[str], errors: Sequence[str]) -> None:
    """The one stderr line of an unusable capture among several, naming the file."""
    line = first_line(error or "; ".join(errors) or "invalid")
    if not line.startswith(printable(capture)):
        line = f"{capture}: {line}"
    line = printable(line)
    print(f"refmla: error: {line}", file=sys.stderr)


def unrun_exit(reports: Sequence[Any], asked: Optional[Sequence[str]], allow_skip: bool) -> int:
    """One stderr line per backend named with --backend that a report holds as skipped; EXIT_NOT_RUN
    unless ``allow_skip``. No --backend (the default set): skipping stays quiet, EXIT_OK."""
    if not asked or allow_skip:
        return EXIT_OK
    missing = [(getattr(r, "capture", "?"), n, why) for r in reports for n, why in unrun_backends(r, asked)]
    for capture, name, why in missing:
        print(printable(f"refmla: error: {capture}: backend {name} was asked for and did not run ({first_line(why)}); "
                        "--allow-skip accepts that"), file=sys.stderr)  # fmt: skip
    return EXIT_NOT_RUN if missing else EXIT_OK
_PRINTED = [0]  # JSON documents printed on stdout by this process (refmla.cli.main: one per command)


def print_json(obj: Any) -> None:
    """Typed results (``to_json``) or plain data as one JSON document on stdout, NaN/Inf as null."""
    text = json.dumps(json_safe(obj), indent=2, allow_nan=False)
    with signals_deferred():  # a signal waits until the document is out: never a cut one
        print(text, flush=True)
        _PRINTED[0] += 1


def json_documents() -> int:
    """How many documents :func:`print_json` has printed in this process."""
    return _PRINTED[0]


def drawable(reports: Sequence[Any]) -> list[Any]:
    """The reports --plot draws (dense attention captures; None: a file not read far enough to tell,
    which the plots skip); every other kind (sparse decode, kv_write, merge) refused in one line on
    stderr, its replay unchanged."""
    keep = []
    for r in reports:
        if getattr(r, "kind", None) in ("dense", None):
            keep.append(r)
        else:
            print(f"refmla: --plot: {r.capture}: not drawn: the plots read dense attention captures, not a {r.kind.replace('_', ' ')} "
                  "capture", file=sys.stderr)  # fmt: skip
    return keep


def need_matplotlib() -> None:
    """--plot without matplotlib: one line, exit 2, before any work."""
    try:
        import refmla.plots  # noqa: F401
    except ImportError as e:
        raise UsageError(str(e).splitlines()[0]) from None

