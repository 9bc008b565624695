"""Check what the README's first command shows: `make demo` in a fresh clone (.ci/run runs this after it).

    python tools/check_quickstart.py [--refmla .venv/bin/refmla] [--capture demo/kimi-k2-tp8-kv-missing.safetensors]

Reads `refmla doctor --json` and `refmla replay CAPTURE --json` and passes only when
  doctor: triton is usable, and extend is usable through SGLang's Triton extend kernel
          (not only through refmla's pure-PyTorch fallback);
  replay: exits 1 with verdict `diverged` and diagnosis `observed`; `observed` fails, explained by
          kv_range_missing on the request and range the demo planted; triton passes, with its split
          partials compared and passing; extend passes through SGLang's kernel; reference passes.
Prints one line, `quickstart ok: ...`, or one `quickstart REGRESSED: ...` line per regression
(exit 1). Standard library only: any python runs it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

PLANTED_HYPOTHESIS = "kv_range_missing"  # what `--fault kv_range_zero` must be explained by
FALLBACK_MARK = "SGLang Triton extend unavailable"  # doctor's extend detail when only PyTorch runs


def run_json(cmd: list[str]) -> tuple[int, object]:
    """(exit code, parsed stdout) of a refmla command run with --json."""
    p = subprocess.run(cmd + ["--json"], capture_output=True, text=True)
    try:
        return p.returncode, json.loads(p.stdout)
    except ValueError:
        tail = (p.stderr.strip().splitlines() or ["no output"])[-1]
        return p.returncode, f"`{' '.join(cmd)} --json` printed no JSON (exit {p.returncode}): {tail}"


def doctor_problems(rows: list[dict]) -> list[str]:
    by_name = {r["backend"]: r for r in rows}
    problems = []
    triton = by_name.get("triton", {"usable": False, "detail": "missing from doctor"})
    if not triton["usable"]:
        problems.append(f"doctor: triton unavailable: {triton['detail']}")
    extend = by_name.get("extend", {"usable": False, "detail": "missing from doctor"})
    if not extend["usable"]:
        problems.append(f"doctor: extend unavailable: {extend['detail']}")
    elif FALLBACK_MARK in extend["detail"]:
        why = extend["detail"].split(FALLBACK_MARK, 1)[1].strip(" :)")
        problems.append(f"doctor: extend runs only its pure-PyTorch fallback, not SGLang's kernel: {why}")
    return problems


def replay_problems(rc: int, rep: dict) -> list[str]:
    problems = []
    if rc != 1:
        problems.append(f"replay exited {rc}, not 1 (the planted fault found)")
    if (rep.get("verdict"), rep.get("diagnosis")) != ("diverged", "observed"):
        problems.append(f"replay: verdict {rep.get('verdict')}, diagnosis {rep.get('diagnosis')}, "
                        f"not diverged / observed")  # fmt: skip
    be = rep.get("backends", {})
    planted = rep.get("meta", {}).get("synth", {}).get("fault", {})
    want = (PLANTED_HYPOTHESIS, planted.get("request"), planted.get("start"), planted.get("end"))
    ex = be.get("observed", {}).get("explanation") or {}
    got = (ex.get("hypothesis"), ex.get("request"), ex.get("detail", {}).get("start"), ex.get("detail", {}).get("end"))
    if be.get("observed", {}).get("status") != "fail" or got != want:
        problems.append(f"replay: observed {be.get('observed', {}).get('status')}, explained by "
                        f"{got} instead of the planted {want} (hypothesis, request, start, end)")  # fmt: skip
    for name in ("reference", "triton", "extend"):
        entry = be.get(name, {})
        if entry.get("status") != "pass":
            problems.append(f"replay: {name} {entry.get('status')}: {entry.get('reason')}")
    splits = be.get("triton", {}).get("splits") or {}
    if be.get("triton", {}).get("status") == "pass" and not (
        splits.get("status") == "pass" and splits.get("compared_splits", 0) > 0
    ):
        problems.append(f"replay: triton's split partials not compared and passing: {splits or 'none'}")
    impl = be.get("extend", {}).get("info", {}).get("implementation")
    if be.get("extend", {}).get("status") == "pass" and impl != "sglang_triton":
        problems.append(f"replay: extend ran {impl}, not SGLang's Triton extend kernel")
    return problems


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--refmla", default=".venv/bin/refmla", help="the refmla that `make demo` installed")
    ap.add_argument("--capture", default="demo/kimi-k2-tp8-kv-missing.safetensors", help="the demo's capture")
    args = ap.parse_args()

    _, rows = run_json([args.refmla, "doctor"])
    problems = [rows] if isinstance(rows, str) else doctor_problems(rows)
    rc, rep = run_json([args.refmla, "replay", args.capture])
    problems += [rep] if isinstance(rep, str) else replay_problems(rc, rep)
    for p in problems:
        print(f"quickstart REGRESSED: {p}")
    if problems:
        return 1
    splits = rep["backends"]["triton"]["splits"]["compared_splits"]
    print(f"quickstart ok: doctor has triton and extend usable through SGLang's kernels; the replay exits 1 "
          f"naming {PLANTED_HYPOTHESIS} on request {rep['backends']['observed']['explanation']['request']}, "
          f"diagnosis observed; triton passes with {splits} split partials, extend through SGLang's kernel")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
