"""`refmla golden generate --out DIR [--suite quick|full]`: write the golden suite, the sparse
decode goldens under DIR/sparse/ (refmla.golden.sparse)."""

from __future__ import annotations

from refmla.cli.common import EXIT_OK, output_path
from refmla.golden import generate
from refmla.golden import sparse as sparse_golden
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


def golden_generate(args) -> int:
    manifest = generate(args.out, suite=args.suite)
    sparse = sparse_golden.generate(args.out / "sparse" if hasattr(args.out, "joinpath") else f"{args.out}/sparse")
    print(f"wrote {len(manifest['cases'])} golden cases to {args.out} and {len(sparse['cases'])} sparse ones to its sparse/")
    return EXIT_OK
