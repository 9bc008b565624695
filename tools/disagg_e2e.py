"""End to end on CPU: for every disaggregated-pair fault, `refmla synth-disagg` writes the pair, `refmla
disagg --json` checks it, and this script checks that the fault was named right: the class (transfer /
metadata / compute / none), the request, layer and rank, and the position, page, transfer-run offset,
step or check. Exit 0 when every fault was named right, 1 otherwise.

    python tools/disagg_e2e.py [--preset disagg] [--fault NAME]... [--backend NAME]... [--jobs N] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from refmla.synthetic.disagg_faults import DISAGG_FAULTS  # noqa: E402


def refmla(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.run([sys.executable, "-m", "refmla", *args], capture_output=True, text=True, env=env)


def wrong(doc: dict, expect: dict) -> list[str]:
    """What the report got wrong about the planted fault (empty: named right)."""
    errs = []
    key = (expect["rid"], expect["layer"], expect["rank"])
    for r in doc["rows"]:
        hit = expect["all_rows"] or (r["rid"], r["layer"], r["rank"]) == key
        want = expect["class"] if hit else "none"
        if r["fault"] != want:
            errs.append(f"{r['rid']} layer {r['layer']} rank {r['rank']}: {r['fault']} != {want}")
    row = next((r for r in doc["rows"] if (r["rid"], r["layer"], r["rank"]) == key), None)
    if row is None:
        return errs + [f"no row for {key}"]
    t = row["transfer"]
    if expect["class"] == "transfer":
        run = t["run"] or {}
        got = (t["first_mismatch"], t["first_page"], run.get("offset"))
        if got != (expect["position"], expect["page"], expect.get("offset")):
            errs.append(f"transfer (position, page, offset) {got} != {(expect['position'], expect['page'], expect.get('offset'))}")
    if expect.get("source_rid") and t["source_rid"] != expect["source_rid"]:
        errs.append(f"source_rid {t['source_rid']} != {expect['source_rid']}")
    if expect.get("check") and expect["check"] not in row["metadata"]["checks"]:
        errs.append(f"metadata checks {row['metadata']['checks']} lack {expect['check']}")
    if expect["class"] == "compute" and (row["decode"]["step"], row["decode"]["diagnosis"]) != (expect["step"], expect["diagnosis"]):
        errs.append(f"decode (step, diagnosis) {(row['decode']['step'], row['decode']['diagnosis'])}")
    if expect.get("region") and not any(g["status"] == expect["region"] for g in doc["regions"]):
        errs.append(f"no region {expect['region']}")
    if doc["fault"] != expect["class"]:
        errs.append(f"overall fault {doc['fault']} != {expect['class']}")
    return errs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="disagg")
    ap.add_argument("--fault", action="append", choices=list(DISAGG_FAULTS))
    ap.add_argument("--backend", action="append", default=[])
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--keep", default=None, help="write the pairs here and keep them")
    args = ap.parse_args()
    root = Path(args.keep or tempfile.mkdtemp(prefix="refmla-disagg-e2e-"))
    failures = 0
    print(f"{'fault':<16} {'exit':>4} {'seconds':>7}  named")
    for fault in args.fault or list(DISAGG_FAULTS):
        out = root / fault
        made = refmla("synth-disagg", str(out), "--preset", args.preset, "--fault", fault)
        if made.returncode:
            print(f"{fault:<16} synth failed: {made.stderr.strip()[-300:]}")
            failures += 1
            continue
        expect = json.loads(made.stdout.split("planted ", 1)[1].rstrip(")\n"))["expect"]
        t0 = time.perf_counter()
        extra = [a for b in args.backend for a in ("--backend", b)]
        res = refmla("disagg", str(out / "prefill"), "--decode", str(out / "decode"), "--json", "--jobs", str(args.jobs), *extra)
        secs = time.perf_counter() - t0
        try:
            doc = json.loads(res.stdout)
        except json.JSONDecodeError:
            print(f"{fault:<16} {res.returncode:>4} {secs:7.1f}  no JSON: {res.stderr.strip()[-300:]}")
            failures += 1
            continue
        errs = wrong(doc, expect)
        errs += [] if res.returncode == (0 if expect["class"] == "none" else 1) else [f"exit {res.returncode}"]
        failures += bool(errs)
        print(f"{fault:<16} {res.returncode:>4} {secs:7.1f}  {'ok' if not errs else 'WRONG: ' + '; '.join(errs)}")
        print(f"{'':<30}{doc['sentence'][:200]}")
    print(f"\n{'all faults named right' if not failures else f'{failures} fault(s) named wrong'} ({root})")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
