"""Diagnostic power: every planted fault named with its detail, every correct kernel passing.

For every fault in refmla.synthetic.FAULTS (the registry: faults added later are included) on the
Kimi-K2 TP8 and DeepSeek-V3 TP8 presets at page sizes 1 and 256: write the synthetic capture,
replay it in-process (refmla.pipeline.replay_file, reference + observed unless --backend), and
record what the replay said against what was planted:

    named    a fault (EXPECT[name] is a hypothesis): the replay diverges and the observed output's
             explanation names EXPECT[name]. A correct kernel (EXPECT None, the ``none`` and
             ``benign_*`` variants): the verdict is ``agree``; anything else is a false alarm.
    detail   where the planted detail and the explanation share a key (request, delta, start,
             end, split, ratio, logit_cap, ...), the values agree (floats within 1 %).
    search   seconds the hypothesis search took (the explanation's ``seconds``).

A fault that cannot be planted on a preset (ValueError, e.g. a split count above the capture's
max_kv_splits, or no split schedule) is listed as n/a. A planted fault whose output stays within
the tolerance (the replay agrees) is a miss, reported as "below noise": the plant, not the
naming, needs fixing, and the exit code says so.

    python tools/bench_diagnosis.py             # 2 presets x page sizes 1, 256, every fault
    python tools/bench_diagnosis.py --quick     # Kimi-K2 TP8, page size 1, split counts 1, 2, 16 only
    python tools/bench_diagnosis.py --fault seq_len_off_by --page-size 256 --json rows.json
    python tools/bench_diagnosis.py --independent --leg vllm   # vLLM block-table captures (vllm_leg below)

Prints a table and "N/N named, M false alarms, D/C details right, max search S s"; exits 1
unless every fault is named with its detail and no correct kernel is flagged (or a search took
longer than --max-search, when given).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

from refmla.context import ReplayOptions  # noqa: E402
from refmla.pipeline import replay_file  # noqa: E402
from refmla.synthetic import EXPECT, FAULTS, MAY_AGREE, preset, synth_capture  # noqa: E402

PRESETS = ("kimi-k2-tp8", "deepseek-v3-tp8")
PAGE_SIZES = (1, 256)
QUICK_SPLITS = {"benign_splits_1", "benign_splits_2", "benign_splits_16"}
ALIASES = {"mapping": ("heads",)}  # a planted key -> other explanation keys that carry the same value
FLOAT_RTOL = 1e-2


@dataclass
class Row:
    preset: str
    page_size: int
    fault: str
    expect: Optional[str]
    status: str  # "named" | "missed" | "wrong" | "false_alarm" | "pass" | "n/a" | "error"
    verdict: Optional[str] = None
    diagnosis: Optional[str] = None
    hypothesis: Optional[str] = None
    detail_ok: Optional[bool] = None  # None: no key in common (or nothing named)
    detail_keys: list = field(default_factory=list)
    planted: dict = field(default_factory=dict)
    explained: dict = field(default_factory=dict)
    search_s: Optional[float] = None
    replay_s: Optional[float] = None
    worst_ratio: Optional[float] = None  # the observed output's worst error / allowed
    note: str = ""

    @property
    def ok(self) -> bool:
        return self.status in ("named", "pass", "n/a") and self.detail_ok is not False


# --------------------------------------------------------------------------------------------
# One case
# --------------------------------------------------------------------------------------------


def same_value(a: Any, b: Any) -> bool:
    """Planted vs explained value: floats within FLOAT_RTOL, sequences element-wise, else equality."""
    if isinstance(a, bool) or isinstance(b, bool):
        return a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(float(a), float(b), rel_tol=FLOAT_RTOL, abs_tol=1e-12)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b))
    if isinstance(a, str) and isinstance(b, str) and " or " in b:  # "zeroed or dropped": indistinguishable here
        return a in b.split(" or ")
    return a == b


def compare_detail(planted: dict, explained: dict) -> tuple[Optional[bool], list[str]]:
    """(all shared keys agree, the keys compared); None when no key is shared.

    A planted key is compared with the explanation's key of the same name, or with an alias
    (ALIASES) whose value has a comparable type: a list is not compared with a sentence."""
    keys, ok = [], True
    for key, want in planted.items():
        if key == "fault":
            continue
        names = (key, *ALIASES.get(key, ()))
        found = [explained[n] for n in names if n in explained and _comparable(want, explained[n])]
        if not found:
            continue
        keys.append(key)
        ok &= any(same_value(want, got) for got in found)
    return (ok if keys else None), keys


def _comparable(a: Any, b: Any) -> bool:
    num = (int, float)
    seq = (list, tuple)
    return (isinstance(a, num) and isinstance(b, num)) or (isinstance(a, seq) and isinstance(b, seq)) or (
        type(a) is type(b)
    )


def explained_fields(expl) -> dict:
    """The explanation's request, detail and extra as one flat dict (detail wins on a clash)."""
    if expl is None:
        return {}
    return {**expl.extra, **expl.detail, "request": expl.request}


def run_case(name: str, P: int, fault: str, folder: Path, opts: ReplayOptions) -> Row:
    row = Row(preset=name, page_size=P, fault=fault, expect=EXPECT.get(fault), status="error")
    path = folder / f"{name}-p{P}-{fault}.safetensors"
    try:
        row.planted = synth_capture(path, preset(name, page_size=P), fault)
    except ValueError as e:
        row.status, row.note = "n/a", str(e)
        return row
    t0 = time.perf_counter()
    rep = replay_file(path, opts)
    row.replay_s = round(time.perf_counter() - t0, 3)
    path.unlink(missing_ok=True)
    obs = rep.backends.get("observed")
    row.verdict, row.diagnosis = rep.verdict, rep.diagnosis
    row.worst_ratio = obs.worst.ratio if obs and obs.worst is not None else None
    expl = obs.explanation if obs else None
    if expl is not None:
        row.hypothesis, row.search_s = expl.hypothesis, expl.seconds
        row.explained = json.loads(json.dumps(explained_fields(expl), default=str))
    judge(row)
    return row


def judge(row: Row) -> None:
    """Set row.status (and the detail check) from what the replay said."""
    if row.expect is None:
        row.status = "pass" if row.verdict == "agree" else "false_alarm"
        if row.status == "false_alarm":
            row.note = f"a correct kernel reported {row.verdict} ({row.diagnosis}, {row.hypothesis or 'unexplained'})"
        return
    if row.verdict == "agree" and row.fault in MAY_AGREE:
        row.status, row.note = "n/a", "within the tolerance on this preset (a rounding change that may agree)"
        return
    if row.verdict == "agree":
        row.status, row.note = "missed", "below noise: the planted output is within the tolerance"
        return
    if row.verdict != "diverged":
        row.status, row.note = "error", f"verdict {row.verdict}"
        return
    if row.hypothesis != row.expect:
        row.status = "wrong" if row.hypothesis else "missed"
        row.note = f"named {row.hypothesis or 'nothing'}, expected {row.expect}"
        return
    row.status = "named"
    row.detail_ok, row.detail_keys = compare_detail(row.planted, row.explained)
    if row.detail_ok is False:
        diff = {k: (row.planted[k], row.explained.get(k)) for k in row.detail_keys}
        row.note = f"detail differs (planted, explained): {diff}"


# --------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------


def faults_to_run(args) -> list[str]:
    names = list(args.fault or FAULTS)
    if args.quick and not args.fault:
        names = [f for f in names if not f.startswith("benign_splits_") or f in QUICK_SPLITS]
    return names


def render(row: Row) -> str:
    search = f"{row.search_s:6.3f}" if row.search_s is not None else "     -"
    ratio = f"{row.worst_ratio:7.2f}" if row.worst_ratio is not None else "      -"
    detail = {True: "ok", False: "WRONG", None: "-"}[row.detail_ok]
    said = row.hypothesis or (row.verdict or "")
    mark = "" if row.ok else "  <-- " + row.note
    if row.status == "n/a":
        said, mark = "", f"  ({row.note})"
    return (f"{row.preset:<16} {row.page_size:>4} {row.fault:<22} {str(row.expect):<20} {said:<22} "
            f"{row.status:<11} {detail:<6} {search} {ratio}{mark}")  # fmt: skip


def summary(rows: list[Row]) -> tuple[str, bool]:
    faults = [r for r in rows if r.expect is not None and r.status != "n/a"]
    benign = [r for r in rows if r.expect is None and r.status != "n/a"]
    named = [r for r in faults if r.status == "named"]
    alarms = [r for r in benign if r.status != "pass"]
    checked = [r for r in named if r.detail_ok is not None]
    right = [r for r in checked if r.detail_ok]
    searches = [r.search_s for r in rows if r.search_s is not None]
    worst = max(searches, default=0.0)
    na = sum(r.status == "n/a" for r in rows)
    ratios = [r.worst_ratio for r in benign if r.worst_ratio is not None]
    line = (f"{len(named)}/{len(faults)} named, {len(alarms)} false alarms ({len(benign)} correct kernels, "
            f"worst error/allowed {max(ratios, default=0.0):.2f}), {len(right)}/{len(checked)} details right, "
            f"max search {worst:.2f} s; {na} n/a")  # fmt: skip
    ok = len(named) == len(faults) and not alarms and len(right) == len(checked)
    return line, ok


# --------------------------------------------------------------------------------------------
# The vLLM leg of --independent (issue 27): block-table captures tools/planting_vllm.py writes
# with its own loop (vLLM's null block, uniform split schedule and batch-wide split count, bf16 /
# fp8), each replayed by default (vLLM's own kernel among the backends) and through vllm_triton.
# --------------------------------------------------------------------------------------------

VLLM_FULL = {"deepseek-v3-tp8": {"heads": 16}, "kimi-k2-tp8": {"heads": 8}}  # heads per TP8 rank
VLLM_QUICK = {"2 heads, 1617 tokens": {"heads": 2, "seq_lens": (1030, 77, 283, 227)}}


def vllm_leg(quick: bool) -> int:
    """Every (shape, block 16 / 64, bf16 / fp8, clean or planted) case replayed by default and through
    vllm_triton: a clean one must agree, a fault be named with its detail and diagnosed ``observed``."""
    import planting_vllm as pv

    from refmla.capture import write_capture

    tally: dict[str, int] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for label, over in (VLLM_QUICK if quick else VLLM_FULL).items():
            for block in (16, 64):
                for fp8 in (False, True):
                    spec = pv.VllmSpec(block=block, fp8=fp8, **over)
                    for plant in ("none", *pv.PLANTS):
                        t, meta, detail = pv.capture(spec, plant)
                        path = write_capture(Path(tmp) / f"{plant}.safetensors", t, meta, compact=False)
                        for leg in ("default", "vllm_triton"):
                            t0 = time.perf_counter()
                            report = replay_file(path, ReplayOptions(backends=None if leg == "default" else [leg]))
                            outcome, said = _vllm_outcome(report, pv, plant, detail, spec.fault_request)
                            tally[outcome] = tally.get(outcome, 0) + 1
                            print(f"{label:26s} block {block:2d} {'fp8' if fp8 else 'bf16':4s} {plant:20s} {leg:11s} "
                                  f"{outcome:15s} {time.perf_counter() - t0:6.1f}s  {said[:100]}", flush=True)  # fmt: skip
    clean = tally.get("agree", 0) + tally.get("false alarm", 0)
    faults = sum(tally.values()) - clean
    print(f"vLLM leg: {tally.get('false alarm', 0)} false alarms of {clean} clean; {tally.get('named', 0)}/{faults} "
          f"named and diagnosed observed, {tally.get('named elsewhere', 0)} named but not diagnosed observed, "
          f"{tally.get('wrong', 0)} wrong, {tally.get('unexplained', 0)} unexplained, "
          f"{tally.get('below noise', 0)} below noise")  # fmt: skip
    return 0 if tally.get("named", 0) == faults and not tally.get("false alarm") else 1


def _vllm_outcome(report, pv, plant: str, detail: dict, request: int) -> tuple[str, str]:
    """(outcome, what the replay said) of one vLLM-leg case: a fault is named when the explanation
    names the planted hypothesis, on the planted request, with the planted detail."""
    entry = report.backends["observed"]
    e = entry.explanation
    said = e.text() if e else (entry.localization.text() if entry.localization else report.diagnosis_text)
    if plant == "none":
        return ("agree" if report.verdict == "agree" else "false alarm"), report.diagnosis_text
    if report.verdict == "agree":
        return "below noise", said
    _, hypothesis, keys = pv.PLANTS[plant]
    right = e is not None and e.hypothesis == hypothesis and e.request == request
    if right and all(e.detail.get(k) == detail[k] for k in keys):
        return ("named" if report.diagnosis == "observed" else "named elsewhere"), said
    return ("wrong" if e is not None and e.complete else "unexplained"), said


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", action="append", help=f"repeatable (default: {', '.join(PRESETS)})")
    p.add_argument("--page-size", type=int, action="append", help="repeatable (default: 1 and 256)")
    p.add_argument("--fault", action="append", choices=list(FAULTS), help="repeatable (default: all)")
    p.add_argument("--quick", action="store_true", help="Kimi-K2 TP8 at page size 1; split counts 1, 2, 16 only")
    p.add_argument("--backend", action="append", default=[], help="also replay through these backends")
    p.add_argument("--max-search", type=float, default=None, help="fail when a search takes longer (seconds)")
    p.add_argument("--json", metavar="PATH", help="write the rows as JSON")
    p.add_argument("--independent", action="store_true",
                   help="faults planted by tools/planting.py (its own loop, not refmla's): tools/bench_planted.py")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--leg", choices=("all", "sglang", "vllm"), default="all",
                   help="with --independent: both legs (default), tools/planting.py's only, or the vLLM leg only")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    vllm_rc = 0
    if args.independent and args.leg != "sglang":  # the vLLM leg (tools/planting_vllm.py), then the other
        sys.path.insert(0, os.path.dirname(__file__))
        vllm_rc = vllm_leg(args.quick)
        if args.leg == "vllm":
            return vllm_rc
    if args.independent:
        sys.path.insert(0, os.path.dirname(__file__))
        from bench_planted import independent_main

        return independent_main(args.quick) or vllm_rc
    presets = args.preset or (PRESETS[:1] if args.quick else PRESETS)
    pages = args.page_size or ((1,) if args.quick else PAGE_SIZES)
    opts = ReplayOptions(backends=args.backend)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, load {load:.1f} on {os.cpu_count()} CPUs; "
          f"backends reference, observed{''.join(', ' + b for b in args.backend)}")  # fmt: skip
    print(f"{'preset':<16} {'page':>4} {'fault':<22} {'expect':<20} {'said':<22} {'status':<11} {'detail':<6} "
          f"{'search':>6} {'err/tol':>7}")  # fmt: skip
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in presets:
            for P in pages:
                for fault in faults_to_run(args):
                    rows.append(run_case(name, P, fault, Path(tmp), opts))
                    print(render(rows[-1]), flush=True)
    line, ok = summary(rows)
    slow = [r for r in rows if args.max_search is not None and (r.search_s or 0) > args.max_search]
    for name in presets:
        s = [r.search_s for r in rows if r.preset == name and r.search_s is not None]
        print(f"{name}: max search {max(s, default=0.0):.2f} s over {len(s)} searches")
    print(line + (f"; {len(slow)} searches over {args.max_search} s" if slow else ""))
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in rows], indent=1, default=str))
    return 0 if ok and not slow else 1


if __name__ == "__main__":
    sys.exit(main())
