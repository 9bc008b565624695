"""`refmla golden generate`: the dense suite (build.py), the sparse goldens (sparse.py, under
``DIR/sparse/``), the indexer goldens (indexer.py, under ``DIR/indexer/``) and the context-parallel
ones (dcp.py, under ``DIR/dcp/``) written as one suite: every target checked before anything is
written (a file refmla did not write is refused, never replaced), the cases first, the manifests
last (the sparse one, the indexer one, the DCP one, then ``DIR/manifest.json``), and on SIGINT /
SIGTERM or a failure every manifest as it was
before the command (refmla.golden.build.write_with_manifests)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from refmla.atomic import make_dir
from refmla.golden import dcp, indexer, sparse
from refmla.golden.build import DENSE_FORMAT, MANIFEST, case_paths, dense_manifest, write_case, write_with_manifests
from refmla.golden.cases import SUITES


def generate_all(out_dir: Any, suite: str = "quick") -> tuple[dict[str, Any], ...]:
    """Write the whole golden suite to ``out_dir``; returns (dense, sparse, indexer, DCP manifest)."""
    if suite not in SUITES:
        raise KeyError(f"unknown suite {suite!r}; choose from {', '.join(SUITES)}")
    out = make_dir(out_dir)
    low = Path(out) / "sparse"  # made once every target is checked
    idx = Path(out) / "indexer"
    cp = Path(out) / "dcp"
    cases = list(SUITES[suite].values())

    def write() -> list[tuple[Path, dict[str, Any]]]:
        entries = [write_case(case, out) for case in cases]
        make_dir(low)
        low_manifest = sparse.write_cases(low)
        make_dir(idx)
        idx_manifest = indexer.write_cases(idx)
        make_dir(cp)
        cp_manifest = dcp.write_cases(cp)
        return [(low / sparse.MANIFEST, low_manifest), (idx / indexer.MANIFEST, idx_manifest),
                (cp / dcp.MANIFEST, cp_manifest), (out / MANIFEST, dense_manifest(suite, entries))]  # fmt: skip

    targets = case_paths(cases, out) + sparse.case_paths(low) + indexer.case_paths(idx) + dcp.case_paths(cp)
    manifests = {low / sparse.MANIFEST: sparse.SPARSE_FORMAT, idx / indexer.MANIFEST: indexer.INDEXER_FORMAT,
                 cp / dcp.MANIFEST: dcp.DCP_FORMAT,
                 out / MANIFEST: DENSE_FORMAT}  # fmt: skip
    docs = write_with_manifests(targets, manifests, write)
    return docs[3][1], docs[0][1], docs[1][1], docs[2][1]


__all__ = ["generate_all"]
