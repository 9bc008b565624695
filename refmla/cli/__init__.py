"""The command line (docs/contract.md, section 2): it parses, calls plain functions, prints.

One module per command group, each adding its parser, and what they share:

    common.py        exit codes, usage errors, capture paths, JSON on stdout
    replay_flags.py  the flags of every command that replays (replay, disagg) and their bounds
    replay.py    refmla replay
    cp.py        refmla replay-cp (a context-parallel step's rank captures as one call)
    inspect.py   refmla inspect
    diffkv.py    refmla diff-kv
    disagg.py    refmla disagg
    regions.py   refmla regions (the MR region check of a capture or of a model's pool)
    synth.py     refmla synth / synth-disagg
    doctor.py    refmla doctor
    golden.py    refmla golden generate / check
    sweep.py     refmla sweep
    capture.py   refmla capture run (the hook itself is refmla.hook)

Exit codes for every command: 0 everything checked passed, 1 something diverged or
mismatched, 2 the input is invalid or unusable (one line naming the file and tensor or key).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence

from refmla import __version__
from refmla.backends.triton_interp import ensure_interpreter
from refmla.capture import CaptureError
from refmla.atomic import WriteError
from refmla.kernel import InterfaceError
from refmla.cli import cp, diffkv, disagg, doctor, golden, inspect, regions, replay, sweep, synth
from refmla.cli.capture import add_capture_parser
from refmla.cli.common import EXIT_INVALID, UsageError, describe_inputs, json_documents, print_json
from refmla.signals import EXIT_SIGINT, EXIT_SIGTERM, Terminated, sigterm_raises

EXIT_EPIPE = 141  # stdout closed early (a pipe to head): 128 + SIGPIPE, nothing on stderr
from refmla.util import PrintableStream, error_text, first_line, printable, steady_heap


class ParseFailed(SystemExit):
    """A usage error found by argparse (exit 2), with its one line."""

    def __init__(self, line: str):
        super().__init__(EXIT_INVALID)
        self.line = line


class Parser(argparse.ArgumentParser):
    """argparse with the contract's usage error: one line on stderr, exit 2 (subcommands inherit it)."""

    def error(self, message: str):  # type: ignore[override]
        line = f"{self.prog}: {first_line(message)} (see {self.prog} --help)"
        print(f"refmla: error: {line}", file=sys.stderr)
        raise ParseFailed(line)


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="refmla", description="Replay and check absorbed-MLA decode captures.")
    p.add_argument("--version", action="version", version=f"refmla {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    replay.add_parser(sub)
    cp.add_parser(sub)
    inspect.add_parser(sub)
    diffkv.add_parser(sub)
    disagg.add_parser(sub)
    regions.add_parser(sub)
    synth.add_parser(sub)
    doctor.add_parser(sub)
    golden.add_parser(sub)
    sweep.add_parser(sub)
    add_capture_parser(sub)
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The command line; everything it writes goes through refmla.util.printable (no raw file bytes)."""
    out, err = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = PrintableStream(out), PrintableStream(err)
    if argv is None:  # the `refmla` process itself: its freed blocks go back to the system (refmla.util);
        steady_heap()  # a caller's process (the Python API, main(argv) in-process) keeps its allocator as it is
    wants_json, printed = "--json" in (sys.argv[1:] if argv is None else list(argv)), json_documents()
    try:
        with sigterm_raises():
            return _main(argv, wants_json, printed)
    except BrokenPipeError:  # stdout closed early (`refmla ... | head`): no blame on any input, no traceback
        return _closed_stdout(out)
    except ParseFailed as e:  # --json: still one document on stdout
        _json_error(wants_json, printed, e.line)
        raise
    except KeyboardInterrupt:  # a signal before or after the command's own handling
        return EXIT_SIGINT
    except Terminated:
        return EXIT_SIGTERM
    finally:
        sys.stdout, sys.stderr = out, err


def _closed_stdout(out) -> int:
    """The reader of stdout went away: point stdout at /dev/null (no second error at exit), exit 141 (128 + SIGPIPE)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, out.fileno())
    except (OSError, ValueError, AttributeError):
        pass
    return EXIT_EPIPE


def _json_error(wants_json: bool, printed: int, line: str) -> None:
    """Under --json, a command that ends in an error before printing its document prints
    ``{"ok": false, "error": LINE}``: stdout is always exactly one JSON document (docs/contract.md section 3)."""
    if wants_json and json_documents() == printed:
        print_json({"ok": False, "error": line})


def _main(argv: Optional[Sequence[str]] = None, wants_json: bool = False, printed: int = 0) -> int:
    ensure_interpreter()  # no GPU: the Triton interpreter, chosen before anything imports triton
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (CaptureError, UsageError, WriteError, InterfaceError) as e:  # InterfaceError: refmla.kernel's
        print(f"refmla: error: {printable(first_line(e))}", file=sys.stderr)
        _json_error(wants_json, printed, printable(first_line(e)))
        return EXIT_INVALID
    except KeyboardInterrupt:
        return EXIT_SIGINT
    except Terminated:
        return EXIT_SIGTERM
    except BrokenPipeError:
        raise  # main() ends quietly: the reader went away, nothing is wrong with the input
    except Exception as e:  # never a traceback for the user; REFMLA_DEBUG=1 shows it
        if os.environ.get("REFMLA_DEBUG"):
            raise
        where = printable(describe_inputs(args))
        where = f"{where}: " if where else ""
        print(f"refmla: error: {where}{error_text(e)} (set REFMLA_DEBUG=1 for the traceback)", file=sys.stderr)
        _json_error(wants_json, printed, f"{where}{error_text(e)}")
        return EXIT_INVALID


__all__ = ["main", "build_parser", "UsageError"]
