"""`refmla golden generate --out DIR [--suite quick|full]`: write the golden suite, the sparse
decode goldens under DIR/sparse/ (refmla.golden.sparse)."""

from __future__ import annotations

from refmla.cli.common import EXIT_OK, output_path
from refmla.golden.suite import generate_all


def add_parser(sub) -> None:
    g = sub.add_parser("golden", help="golden files")
    gsub = g.add_subparsers(dest="golden_command", required=True)
    gg = gsub.add_parser("generate", help="write the golden suite")
    gg.add_argument("--out", required=True, type=output_path)
    gg.add_argument("--suite", choices=("quick", "full"), default="quick")
    gg.set_defaults(func=golden_generate)


def golden_generate(args) -> int:
    manifest, sparse = generate_all(args.out, suite=args.suite)
    print(f"wrote {len(manifest['cases'])} golden cases to {args.out} and {len(sparse['cases'])} sparse ones to its sparse/")
    return EXIT_OK
