"""`refmla golden generate --out DIR [--suite quick|full]`: write the golden suite, the sparse
decode goldens under DIR/sparse/ (refmla.golden.sparse), the context-parallel ones under DIR/dcp/
(refmla.golden.dcp).

`refmla golden check DIR|FILE... [--backend NAME]... [--json]`: every golden file (a folder's
manifest, its indexer/ and dcp/ cases, or the files and DCP case folders named) against each backend
(default: the golden backends and the installed packages' kernels; ``--backend module:function``
names a kernel outside refmla; a sparse top-k kernel, layout ``sparse_topk``, is checked on a
folder's sparse/ goldens); an indexer golden (DIR/indexer/, refmla.golden.indexer) against the
indexer backends; exit 0 all pass, 1 one fails or errs."""

from __future__ import annotations

import time
from pathlib import Path

from refmla.backends import is_sparse_kernel, plugin_defaults
from refmla.golden import sparse as sparse_golden
from refmla.backends.named import Choices
from refmla.cli.common import EXIT_DIVERGED, EXIT_OK, UsageError, is_dir, output_path, print_json
from refmla.golden import (CHECK_BACKENDS, GoldenResult, backend_applies, check, check_isolated, load_manifest,
                           needs_isolation)
from refmla.golden import dcp
from refmla.golden import indexer as indexer_golden
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
                                     "the sparse decode goldens under OUT/sparse/ and the context-parallel ones under "
                                     "OUT/dcp/ (docs/golden.md).")  # fmt: skip
    gg.add_argument("--out", required=True, type=output_path, metavar="OUT",
                    help="the folder to write into (created; a manifest.json there that is not a golden one is "
                         "refused, never replaced); the repository's is golden/")  # fmt: skip
    gg.add_argument("--suite", choices=("quick", "full"), default="quick",
                    help=f"quick: the {len(SUITES['quick'])} cases checked in under golden/ (default); full: those "
                         f"and {len(SUITES['full']) - len(SUITES['quick'])} more")  # fmt: skip
    gg.set_defaults(func=golden_generate)
    gc = gsub.add_parser("check", help="check backends against golden files (a folder's manifest, or files)")
    gc.add_argument("paths", nargs="+", metavar="DIR|FILE")
    gc.add_argument("--backend", action="append", choices=Choices(dict.fromkeys((*CHECK_BACKENDS, *indexer_golden.KERNELS))),
                    metavar="NAME",
                    help=f"backend to check (repeatable; default {' '.join(CHECK_BACKENDS)} and the installed "
                         "packages' kernels); or your kernel as module:function (docs/own-kernel.md)")  # fmt: skip
    gc.add_argument("--json", action="store_true", help="the results as JSON on stdout")
    gc.set_defaults(func=golden_check)


def golden_generate(args) -> int:
    manifest, sparse, indexer, cp = generate_all(args.out, suite=args.suite)
    print(f"wrote {len(manifest['cases'])} golden cases to {args.out}, {len(sparse['cases'])} sparse ones to its "
          f"sparse/, {len(indexer['cases'])} indexer ones to its indexer/ and {len(cp['cases'])} context-parallel "
          "ones to its dcp/")
    return EXIT_OK


def golden_files(paths) -> list[Path]:
    """Each folder's golden files in its manifest's order, then its indexer/ goldens and its DCP case
    folders; each file and DCP case folder as given. The sparse goldens are :func:`sparse_files`'."""
    files: list[Path] = []
    for p in paths:
        if is_dir(p):
            if dcp.is_case(p):
                files.append(Path(p))
                continue
            steps = dcp.case_folders(p)
            try:
                fmt = load_manifest(p).get("format")
                if fmt == sparse_golden.SPARSE_FORMAT or (steps and fmt == dcp.DCP_FORMAT):
                    pass  # a sparse/ folder (sparse_files) or a dcp/ one (its steps, below)
                else:
                    files += [Path(p) / c["file"] for c in load_manifest(p)["cases"]]
            except (FileNotFoundError, ValueError, KeyError, AttributeError) as e:
                raise UsageError(f"{p}: not a golden folder ({e})") from None
            idx = Path(p) / "indexer"
            if (idx / indexer_golden.MANIFEST).is_file():
                files += [idx / c["file"] for c in indexer_golden.load_manifest(idx)["cases"]]
            files += steps
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
    if file_mode(path) == "indexer":  # an indexer golden: its own check (refmla.golden.indexer)
        return indexer_golden.check(path, backend)
    isolate, no_room = needs_isolation(path)
    if no_room:
        return GoldenResult(golden_meta(path).get("case", path.stem), backend, BackendEntry("skipped", reason=no_room))
    return check_isolated(path, backend) if isolate else check(path, backend)


def sparse_files(paths) -> list[tuple[Path, str]]:
    """(file, why) of the sparse goldens (refmla.golden.sparse) of each folder given: its sparse/, or
    the folder itself when it is one; a sparse golden file given by name."""
    found = []
    for p in paths:
        if not is_dir(p):
            if Path(p).is_file() and file_mode(Path(p)) == "sparse":
                found.append((Path(p), ""))
            continue
        for folder in (Path(p), Path(p) / "sparse"):
            m = folder / sparse_golden.MANIFEST
            if m.is_file() and sparse_golden.load_manifest(folder).get("format") == sparse_golden.SPARSE_FORMAT:
                found += [(folder / c["file"], c.get("why", "")) for c in sparse_golden.load_manifest(folder)["cases"]]
    return found


def check_sparse(path: Path, backend: str, why: str) -> GoldenResult:
    """A sparse kernel (refmla's, or a sparse top-k kernel outside refmla) on one sparse golden, as a
    GoldenResult."""
    t0 = time.perf_counter()
    r = sparse_golden.check(path, backend)
    entry = r.entry or BackendEntry({"FAIL": "fail"}.get(r.status, r.status), reason=r.reason or None)
    return GoldenResult(path.stem, backend, entry, why, f"refmla replay {path} --backend {backend}", time.perf_counter() - t0)


def golden_check(args) -> int:
    backends = list(dict.fromkeys(args.backend or [*CHECK_BACKENDS, *plugin_defaults()]))
    results = []
    for path in golden_files(args.paths):
        if path.is_dir():  # a DCP step: its ranks' captures judged as one call
            results += [dcp.check(path, b) for b in backends if dcp.applies(b)]
            continue
        mode = file_mode(path) or "decode"
        if mode == "sparse":  # a sparse golden named alone: sparse_files (below)
            continue
        if mode == "indexer":  # the indexer backends (and reference) asked for, or all of them
            asked = [b for b in backends if b in indexer_golden.CHECK_BACKENDS] if args.backend else None
            results += [check_one(path, b) for b in (asked if asked is not None else indexer_golden.CHECK_BACKENDS)]
            continue
        for b in backends:
            if backend_applies(b, mode) and b not in indexer_golden.KERNELS:
                results.append(check_one(path, b))
    mine = [b for b in backends if is_sparse_kernel(b)]  # sparse top-k kernels outside refmla
    sparse = mine + ([b for b in backends if b in sparse_golden.CHECK_BACKENDS] if args.backend
                     else list(sparse_golden.CHECK_BACKENDS))  # fmt: skip
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
