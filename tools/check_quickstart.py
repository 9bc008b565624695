"""Check what the README shows: `make demo` in a fresh clone, and every README block marked runnable
on CPU (.ci/run runs this after `make demo`).

    python tools/check_quickstart.py [--refmla .venv/bin/refmla] [--capture demo/kimi-k2-tp8-kv-missing.safetensors]
                                     [--readme README.md [--update]]

Reads `refmla doctor --json` and `refmla replay CAPTURE --json` and passes only when
  doctor: triton is usable, and extend is usable through SGLang's Triton extend kernel
          (not only through refmla's pure-PyTorch fallback);
  replay: exits 1 with verdict `diverged` and diagnosis `observed`; `observed` fails, explained by
          kv_range_missing on the request and range the demo planted; triton passes, with its split
          partials compared and passing; extend passes through SGLang's kernel; reference passes.

With --readme README.md it also runs every block marked `<!-- cpu -->` (the line before its fence)
of the README and of the docs/*.md pages beside it, in that order, in one scratch folder that holds a copy of --capture at the same relative
path (so `refmla replay demo/...` runs as printed); `refmla` and `python` come from --refmla's folder:
  bash blocks     each command line; exit 0 or 1 (a finding is output), or the `# exit N` its
                  comment names; never a traceback. What they print is not shown, so not compared.
  `$ ` blocks     each `$ ` line is a command (exit as for bash blocks); the lines after it, up to the
                  next `$ ` line, are what it prints on stdout, compared WHOLE, line for line (same
                  number of lines, each line equal after the masking below). stderr is not compared.
  python blocks   run whole; each `print(...)  # TEXT` line's TEXT must be the next output line
                  (masked the same way).

Masking: what may differ between two machines that run the same tree, and nothing else. Both the
README's line and the printed line are rewritten, then compared for equality:
  1. spaces    runs of spaces are one space; leading and trailing spaces dropped (a table's column
               widths follow its widest cell); a line of dashes and spaces (a table's rule) keeps
               only its number of columns;
  2. times     a number followed by a time unit (`s`, `ms`, `min`, `h`) is <time>;
  3. versions  a dotted version of three or more parts (`0.5.23`, `2.13.0+cpu`) is <version>;
  4. paths     an absolute path (a `/` at the start of a word) is <path>;
  5. decimals  a number with a decimal point or an exponent matches one within 1 % of it (relative
               to the larger: 0.00765 matches 0.00768, not 0.0078; refmla prints 3 significant
               digits); integers are exact (counts, rows, positions, byte sizes, request numbers).
  6. `...`     a README word ending in `...` (refmla's own cut of a long note, or the README's cut of
               a line) ends the comparison of that line: the words before it must be equal and the
               word's text before `...` must share its start with the printed word.
So a row added, removed or renamed, a status, a count, a diagnosis, a sentence changed: each fails.
--update rewrites the printed output of each `$ ` block with what ran (review the diff: a README
cut with `...` is replaced by the whole line).

Prints one line, `quickstart ok: ...`, or one `quickstart REGRESSED: ...` line per regression
(exit 1). Standard library only: any python runs it.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
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

# the masking rules of the module docstring, in its order
RULE = re.compile(r"^[-\s]*-[-\s]*$")  # a table's rule
TIME = re.compile(r"(?<![\w.])\d+(?:\.\d+)?(?:e[-+]?\d+)?\s?(?:s|ms|min|h)\b")
VERSION = re.compile(r"(?<![\w.])\d+\.\d+\.\d+[\w.+-]*")
PATH = re.compile(r"(?<![\w)\]./])/[\w.+-][\w./+-]*")
FLOAT = re.compile(r"(?<![\w.])[-+]?(?:\d+\.\d*|\.\d+|\d+(?=e[-+]?\d))(?:e[-+]?\d+)?(?!\w|\.\d)")
CUT = "..."


REL = 0.01  # rule 5: how far apart two decimal numbers may be, relative to the larger


def mask(line: str) -> str:
    """One line as it is compared (rules 1-4 of the module docstring; decimal numbers are kept
    for :func:`same_word`)."""
    line = " ".join(line.split())
    if RULE.match(line):
        return f"<rule of {len(line.split())} column(s)>"
    line = TIME.sub("<time>", line)
    line = VERSION.sub("<version>", line)
    return PATH.sub("<path>", line)


def same_word(want: str, got: str) -> bool:
    """Two masked words: equal with each decimal number replaced by #, their numbers within REL (rule 5)."""
    if FLOAT.sub("#", want) != FLOAT.sub("#", got):
        return False
    for a, b in zip((float(x) for x in FLOAT.findall(want)), (float(x) for x in FLOAT.findall(got))):
        if not (a == b or abs(a - b) <= REL * max(abs(a), abs(b))):
            return False
    return True


def same_line(shown: str, printed: str) -> bool:
    """Whether a printed line is the README's, masked, up to a README word that ends in `...` (rule 6)."""
    want, got = mask(shown).split(" "), mask(printed).split(" ")
    for i, w in enumerate(want):
        if w.endswith(CUT):
            stem = w[: -len(CUT)]
            if i >= len(got):
                return stem == ""
            g = got[i][: -len(CUT)] if got[i].endswith(CUT) else got[i]
            return g.startswith(stem) or stem.startswith(g)
        if i >= len(got) or not same_word(w, got[i]):
            return False
    return len(got) == len(want)


def output_problems(where: str, cmd: str, shown: list[str], printed: list[str]) -> list[str]:
    """The first difference between what the README shows a command printing and what it printed."""
    shown, printed = _trim(shown), _trim(printed)
    for n, (s, p) in enumerate(zip(shown, printed), 1):
        if not same_line(s, p):
            return [f"{where}: `{cmd}` printed line {n} {p.strip()!r}, the README shows {s.strip()!r}"]
    if len(shown) != len(printed):
        extra = (printed if len(printed) > len(shown) else shown)[min(len(shown), len(printed))]
        return [f"{where}: `{cmd}` printed {len(printed)} line(s), the README shows {len(shown)} "
                f"(first unmatched: {extra.strip()!r})"]  # fmt: skip
    return []


def _trim(lines: list[str]) -> list[str]:
    lines = [ln.rstrip() for ln in lines]
    while lines and not lines[-1]:
        lines.pop()
    while lines and not lines[0]:
        lines.pop(0)
    return lines


@dataclass
class Block:
    line: int  # where its fence opens in its page (1-based)
    lang: str  # "bash", "python", "" ...
    text: str
    page: str = "README"  # the page it is on, as problems name it


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


def dollar_commands(text: str) -> list[tuple[str, list[str]]]:
    """A `$ ` block's (command, the lines the README shows it printing), in order."""
    out: list[tuple[str, list[str]]] = []
    for ln in text.splitlines():
        if ln.startswith("$ "):
            out.append((ln[2:], []))
        elif out:
            out[-1][1].append(ln)
    return out


def _run(cmd: str, env: dict, cwd: str, python: str = "") -> subprocess.CompletedProcess:
    args = [python, "-c", cmd] if python else ["bash", "-c", cmd]
    return subprocess.run(args, capture_output=True, text=True, env=env, cwd=cwd)


def _exit_problem(where: str, cmd: str, p: subprocess.CompletedProcess) -> list[str]:
    m = re.search(r"#\s*exit (\d+)", cmd)
    allowed = {int(m.group(1))} if m else {0, 1}
    if p.returncode in allowed and "Traceback" not in p.stderr:
        return []
    tail = (p.stderr.strip().splitlines() or ["no stderr"])[-1]
    return [f"{where}: `{cmd.split('  #')[0].strip()}` exited {p.returncode} (expected {sorted(allowed)}): {tail}"]


def block_problems(block: Block, bin_dir: str, cwd: str, printed: dict | None = None) -> list[str]:
    """What of one marked block does not run as printed (the module docstring's rules). ``printed``,
    when given, receives each `$ ` command's stdout (for --update)."""
    env = {**os.environ, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", "")}
    where = f"{block.page} line {block.line}"
    if block.lang == "python":
        p = _run(block.text, env, cwd, python=os.path.join(bin_dir, "python"))
        want = [ln.split("#", 1)[1].strip() for ln in block.text.splitlines() if ln.startswith("print(") and "#" in ln]
        got = p.stdout.splitlines()
        if p.returncode != 0:
            return [f"{where}: python block exited {p.returncode}: {(p.stderr.strip().splitlines() or [''])[-1]}"]
        return [f"{where}: printed {g!r}, the README says {w!r}" for w, g in zip(want, got) if not same_line(w, g)] + (
            [f"{where}: printed {len(got)} line(s), the README shows {len(want)}"] if len(got) < len(want) else [])
    dollar = dollar_commands(block.text)
    if not dollar:
        commands = [ln for ln in block.text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
        return [q for cmd in commands for q in _exit_problem(where, cmd, _run(cmd.split("  #")[0], env, cwd))]
    problems = []
    for cmd, shown in dollar:
        p = _run(cmd.split("  #")[0], env, cwd)
        if printed is not None:
            printed[cmd] = p.stdout
        problems += _exit_problem(where, cmd, p) + output_problems(where, cmd.split("  #")[0].strip(), shown,
                                                                  p.stdout.splitlines())  # fmt: skip
    return problems


def pages(readme: str) -> list[str]:
    """The README, then the pages of the docs/ folder beside it."""
    docs = os.path.join(os.path.dirname(os.path.abspath(readme)), "docs")
    return [readme] + (sorted(glob.glob(os.path.join(docs, "*.md"))) if os.path.isdir(docs) else [])


def readme_problems(readme: str, refmla: str, capture: str = "", update: bool = False) -> tuple[int, list[str]]:
    """(blocks run, problems) of the marked blocks of the README and its docs/ pages, in README order
    then the pages', in one scratch folder holding ``capture`` at its relative path. ``update``:
    rewrite the `$ ` blocks' printed lines with what ran."""
    texts = {}
    for path in pages(readme):
        with open(path, encoding="utf-8") as f:
            texts[path] = f.read()
    name = {p: "README" if p == readme else os.path.join("docs", os.path.basename(p)) for p in texts}
    blocks = {p: [Block(b.line, b.lang, b.text, name[p]) for b in readme_blocks(t)] for p, t in texts.items()}
    bin_dir = os.path.dirname(os.path.abspath(refmla))
    printed: dict = {}
    with tempfile.TemporaryDirectory(prefix="refmla-readme-") as cwd:
        if capture and os.path.isfile(capture) and not os.path.isabs(capture):
            os.makedirs(os.path.join(cwd, os.path.dirname(capture)) or cwd, exist_ok=True)
            shutil.copyfile(capture, os.path.join(cwd, capture))
        problems = [q for bs in blocks.values() for b in bs for q in block_problems(b, bin_dir, cwd, printed if update else None)]
    if update:
        for p, bs in blocks.items():
            if any(dollar_commands(b.text) for b in bs):
                _rewrite(p, texts[p], bs, printed)
    return sum(len(bs) for bs in blocks.values()), problems


def _rewrite(readme: str, text: str, blocks: list[Block], printed: dict) -> None:
    """The README with each `$ ` command's shown output replaced by what it printed (atomic rename)."""
    for b in blocks:
        dollar = dollar_commands(b.text)
        if not dollar or b.lang == "python":
            continue
        new = "\n".join(f"$ {cmd}\n" + "\n".join(_trim(printed.get(cmd, "").splitlines())) for cmd, _ in dollar)
        text = text.replace(b.text, new.replace("\n\n$ ", "\n$ "), 1)
    tmp = readme + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, readme)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--refmla", default=".venv/bin/refmla", help="the refmla that `make demo` installed")
    ap.add_argument("--capture", default="demo/kimi-k2-tp8-kv-missing.safetensors", help="the demo's capture")
    ap.add_argument("--readme", default=None, help="also run this README's blocks marked <!-- cpu -->")
    ap.add_argument("--update", action="store_true", help="with --readme: rewrite the `$ ` blocks' output with what ran")
    args = ap.parse_args()
    if args.readme:
        n, problems = readme_problems(args.readme, args.refmla, args.capture, args.update)
        problems += [] if n else [f"{args.readme} has no block marked {MARK}"]
        for p in problems:
            print(f"quickstart REGRESSED: {p}")
        if problems:
            return 1
        print(f"quickstart ok: {n} block(s) marked {MARK} in the README and docs/ run as printed")

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
