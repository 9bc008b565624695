"""`refmla golden check` on the committed golden folder covers every family it holds (dense, sparse/,
indexer/, dcp/), and each family's folder checks alone: a kernel engineer runs one command on a new
image, and a family left out would be a pass that checked nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from refmla.cli import main as refmla_main

GOLDEN = Path(__file__).resolve().parent.parent / "golden"


def manifest_cases(folder: Path) -> set[str]:
    return {Path(c["file"]).stem for c in json.loads((folder / "manifest.json").read_text())["cases"]}


def check_json(capsys, *args) -> tuple[int, list[dict]]:
    rc = refmla_main(["golden", "check", *map(str, args), "--backend", "reference", "--json"])
    return rc, json.loads(capsys.readouterr().out)


def test_the_golden_folder_checks_every_family(capsys):
    rc, results = check_json(capsys, GOLDEN)
    cases = {r["case"] for r in results}
    for family in ("", "sparse", "indexer"):
        missing = manifest_cases(GOLDEN / family) - cases
        assert not missing, (family or "dense", sorted(missing))
    assert any("dcp" in r["case"] for r in results), sorted(cases)  # the DCP step
    assert rc == 0 and all(r["status"] == "pass" for r in results), [r for r in results if r["status"] != "pass"]


@pytest.mark.parametrize("family", ["sparse", "indexer"])
def test_each_familys_folder_checks_alone(capsys, family):
    rc, results = check_json(capsys, GOLDEN / family)
    assert rc == 0 and {r["case"] for r in results} == manifest_cases(GOLDEN / family)
