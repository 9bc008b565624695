"""Check what the README's first command shows: `make demo` in a fresh clone (.ci/run runs this after it).

    python tools/check_quickstart.py [--refmla .venv/bin/refmla] [--capture demo/kimi-k2-tp8-kv-missing.safetensors]

Reads `refmla doctor --json` and `refmla replay CAPTURE --json` and passes only when
  doctor: triton is usable, and extend is usable through SGLang's Triton extend kernel
          (not only through refmla's pure-PyTorch fallback);
  replay: exits 1 with verdict `diverged` and diagnosis `observed`; `observed` fails, explained by
          kv_range_missing on the request and range the demo planted; triton passes, with its split
          partials compared and passing; extend passes through SGLang's kernel; reference passes.
With --readme README.md it also runs every README block marked `<!-- cpu -->` (the line before
its fence) in a scratch folder, `refmla` and `python` taken from the --refmla's folder:
  bash blocks     each command line; exit 0 or 1 (a finding is output), or the `# exit N` its
                  comment names; never a traceback
  `$ ` blocks     the `$ ` lines are commands, the rest the printed output: every backend row
                  printed there (`name  status ...`) must print with the same status
  python blocks   run whole; each `print(...)  # TEXT` line's TEXT must be the next output line
Prints one line, `quickstart ok: ...`, or one `quickstart REGRESSED: ...` line per regression
(exit 1). Standard library only: any python runs it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass

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
    by_name = {r["backend"]: r for r in rows if r.get("kind", "dense") == "dense"}  # not the sparse kernel named triton
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


MARK = "<!-- cpu -->"
ROW = re.compile(r"^(\w+)\s+(pass|FAIL|skipped|error)\s")  # a backend row of a printed table


@dataclass
class Block:
    line: int  # where its fence opens in the README (1-based)
    lang: str  # "bash", "python", "" ...
    text: str


def readme_blocks(text: str) -> list[Block]:
    """The fenced blocks whose fence follows a `<!-- cpu -->` line."""
    lines, out, i = text.splitlines(), [], 0
    while i < len(lines):
        if lines[i].strip() == MARK and i + 1 < len(lines) and lines[i + 1].startswith("```"):
            lang, start, j = lines[i + 1][3:].strip(), i + 2, i + 2
            while j < len(lines) and not lines[j].startswith("```"):
                j += 1
            out.append(Block(i + 2, lang, "\n".join(lines[start:j])))
            i = j
        i += 1
    return out


def _run(cmd: str, env: dict, cwd: str, python: str = "") -> subprocess.CompletedProcess:
    args = [python, "-c", cmd] if python else ["bash", "-c", cmd]
    return subprocess.run(args, capture_output=True, text=True, env=env, cwd=cwd)


def block_problems(block: Block, bin_dir: str, cwd: str) -> list[str]:
    """What of one marked block does not run as printed (the module docstring's rules)."""
    env = {**os.environ, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", "")}
    where, problems = f"README line {block.line}", []
    if block.lang == "python":
        p = _run(block.text, env, cwd, python=os.path.join(bin_dir, "python"))
        want = [ln.split("#", 1)[1].strip() for ln in block.text.splitlines() if ln.startswith("print(") and "#" in ln]
        got = p.stdout.splitlines()
        if p.returncode != 0:
            return [f"{where}: python block exited {p.returncode}: {(p.stderr.strip().splitlines() or [''])[-1]}"]
        return [f"{where}: printed {g!r}, the README says {w!r}" for w, g in zip(want, got) if g.strip() != w] + (
            [f"{where}: printed {len(got)} line(s), the README shows {len(want)}"] if len(got) < len(want) else [])
    dollar = [ln[2:] for ln in block.text.splitlines() if ln.startswith("$ ")]
    commands = dollar or [ln for ln in block.text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    printed = {m.group(1): m.group(2) for ln in block.text.splitlines() if not ln.startswith("$ ") and (m := ROW.match(ln))}
    for cmd in commands:
        m = re.search(r"#\s*exit (\d+)", cmd)
        allowed = {int(m.group(1))} if m else {0, 1}
        p = _run(cmd.split("  #")[0], env, cwd)
        if p.returncode not in allowed or "Traceback" in p.stderr:
            tail = (p.stderr.strip().splitlines() or ["no stderr"])[-1]
            problems.append(f"{where}: `{cmd.split('  #')[0].strip()}` exited {p.returncode} (expected {sorted(allowed)}): {tail}")
        ran = {m.group(1): m.group(2) for ln in p.stdout.splitlines() if (m := ROW.match(ln))}
        problems += [f"{where}: backend {b} printed {ran.get(b, 'nothing')}, the README shows {st}"
                     for b, st in printed.items() if dollar and ran.get(b) != st]  # fmt: skip
    return problems


def readme_problems(readme: str, refmla: str) -> tuple[int, list[str]]:
    """(blocks run, problems) of the README's marked blocks, in a scratch folder."""
    with open(readme, encoding="utf-8") as f:
        blocks = readme_blocks(f.read())
    bin_dir = os.path.dirname(os.path.abspath(refmla))
    with tempfile.TemporaryDirectory(prefix="refmla-readme-") as cwd:
        return len(blocks), [p for b in blocks for p in block_problems(b, bin_dir, cwd)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--refmla", default=".venv/bin/refmla", help="the refmla that `make demo` installed")
    ap.add_argument("--capture", default="demo/kimi-k2-tp8-kv-missing.safetensors", help="the demo's capture")
    ap.add_argument("--readme", default=None, help="also run this README's blocks marked <!-- cpu -->")
    args = ap.parse_args()
    if args.readme:
        n, problems = readme_problems(args.readme, args.refmla)
        problems += [] if n else [f"{args.readme} has no block marked {MARK}"]
        for p in problems:
            print(f"quickstart REGRESSED: {p}")
        if problems:
            return 1
        print(f"quickstart ok: {n} README block(s) marked {MARK} run as printed")

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
