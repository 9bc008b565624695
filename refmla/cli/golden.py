"""`refmla golden generate --out DIR [--suite quick|full]`: write the golden suite, the sparse
decode goldens under DIR/sparse/ (refmla.golden.sparse).

`refmla golden check DIR|FILE... [--backend NAME]... [--json]`: every golden file (a folder's
manifest, or the files named) against each backend (default: the golden backends and the installed
packages' kernels; ``--backend module:function`` names a kernel outside refmla; a sparse top-k
kernel, layout ``sparse_topk``, is checked on a folder's sparse/ goldens); exit 0 all pass, 1 one
fails or errs."""

from __future__ import annotations

import time
from pathlib import Path

from refmla.backends import is_sparse_kernel, plugin_defaults
from refmla.golden import sparse as sparse_golden
from refmla.backends.named import Choices
from refmla.cli.common import EXIT_DIVERGED, EXIT_OK, UsageError, is_dir, output_path, print_json
from refmla.golden import (CHECK_BACKENDS, GoldenResult, backend_applies, check, check_isolated, load_manifest,
                           needs_isolation)
from refmla.golden.suite import generate_all
from refmla.golden.isolate import golden_meta
from refmla.capture.kinds import file_mode
from refmla.results import BackendEntry
from refmla.util import error_text
from refmla.golden.cases import SUITES


def add_parser(sub) -> None:
    g = sub.add_parser("golden", help="golden files")
    gsub = g.add_subparsers(dest="golden_command", required=True)
    gg = gsub.add_parser("generate", help="write the golden suite",
                         description="Write the golden captures (the same bytes on every run), their manifest.json, "
                                     "and the sparse decode goldens under OUT/sparse/ (docs/golden.md).")  # fmt: skip
    gg.add_argument("--out", required=True, type=output_path, metavar="OUT",
                    help="the folder to write into (created; a manifest.json there that is not a golden one is "
                         "refused, never replaced); the repository's is golden/")  # fmt: skip
    gg.add_argument("--suite", choices=("quick", "full"), default="quick",
                    help=f"quick: the {len(SUITES['quick'])} cases checked in under golden/ (default); full: those "
                         f"and {len(SUITES['full']) - len(SUITES['quick'])} more")  # fmt: skip
    gg.set_defaults(func=golden_generate)
    gc = gsub.add_parser("check", help="check backends against golden files (a folder's manifest, or files)")
    gc.add_argument("paths", nargs="+", metavar="DIR|FILE")
    gc.add_argument("--backend", action="append", choices=Choices(CHECK_BACKENDS), metavar="NAME",
                    help=f"backend to check (repeatable; default {' '.join(CHECK_BACKENDS)} and the installed "
                         "packages' kernels); or your kernel as module:function (docs/own-kernel.md)")  # fmt: skip
    gc.add_argument("--json", action="store_true", help="the results as JSON on stdout")
    gc.set_defaults(func=golden_check)


def golden_generate(args) -> int:
    manifest, sparse = generate_all(args.out, suite=args.suite)
    print(f"wrote {len(manifest['cases'])} golden cases to {args.out} and {len(sparse['cases'])} sparse ones to its sparse/")
    return EXIT_OK


def golden_files(paths) -> list[Path]:
    """Each folder's golden files in its manifest's order, each file as given."""
    files: list[Path] = []
    for p in paths:
        if is_dir(p):
            try:
                files += [Path(p) / c["file"] for c in load_manifest(p)["cases"]]
            except (FileNotFoundError, ValueError, KeyError) as e:
                raise UsageError(f"{p}: not a golden folder ({e})") from None
        elif Path(p).is_file():
            try:
                meta = golden_meta(p)
            except Exception as e:
                raise UsageError(f"{p}: not a golden file ({error_text(e)})") from None
            if not meta:
                raise UsageError(f"{p}: not a golden file (its meta has no 'golden'; refmla replay checks a capture)")
            files.append(Path(p))
        else:
            raise UsageError(f"{p}: no such file or folder")
    return files


def check_one(path: Path, backend: str) -> GoldenResult:
    """:func:`refmla.golden.check`; a case whose pool sits past 4 GiB in a child process (or skipped
    without the memory), as the kernel-regression suite runs it."""
    isolate, no_room = needs_isolation(path)
    if no_room:
        return GoldenResult(golden_meta(path).get("case", path.stem), backend, BackendEntry("skipped", reason=no_room))
    return check_isolated(path, backend) if isolate else check(path, backend)


def sparse_files(paths) -> list[tuple[Path, str]]:
    """(file, why) of each folder's sparse/ goldens (refmla.golden.sparse), in its manifest's order."""
    found = []
    for p in paths:
        folder = Path(p) / "sparse"
        if is_dir(p) and (folder / sparse_golden.MANIFEST).is_file():
            found += [(folder / c["file"], c.get("why", "")) for c in sparse_golden.load_manifest(folder)["cases"]]
    return found


def check_sparse(path: Path, backend: str, why: str) -> GoldenResult:
    """A sparse top-k kernel outside refmla on one sparse golden, as a GoldenResult."""
    t0 = time.perf_counter()
    r = sparse_golden.check(path, backend)
    entry = r.entry or BackendEntry({"FAIL": "fail"}.get(r.status, r.status), reason=r.reason or None)
    return GoldenResult(path.stem, backend, entry, why, f"refmla replay {path} --backend {backend}", time.perf_counter() - t0)


def golden_check(args) -> int:
    backends = list(dict.fromkeys(args.backend or [*CHECK_BACKENDS, *plugin_defaults()]))
    results = []
    for path in golden_files(args.paths):
        mode = file_mode(path) or "decode"
        for b in backends:
            if backend_applies(b, mode):
                results.append(check_one(path, b))
    sparse = [b for b in backends if is_sparse_kernel(b)]  # refmla's own sparse kernels: tests/kernel_regression
    for path, why in sparse_files(args.paths) if sparse else ():
        results += [check_sparse(path, b, why) for b in sparse]
    if args.json:
        print_json([r.to_json() for r in results])
    else:
        for r in results:
            print(r.message() if r.status in ("fail", "error") else f"golden {r.case} / {r.backend}: {r.status.upper()}"
                  + (f" ({r.reason})" if r.status == "skipped" and r.reason else ""))  # fmt: skip
        counts = {s: sum(r.status == s for r in results) for s in ("pass", "fail", "error", "skipped")}
        print(", ".join(f"{n} {s}" for s, n in counts.items()))
    return EXIT_DIVERGED if any(r.status in ("fail", "error") for r in results) else EXIT_OK
