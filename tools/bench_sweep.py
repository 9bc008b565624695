"""The sweep's speed and its findings per backend: cases per minute, kernel vs reference time.

    python tools/bench_sweep.py --backend triton --budget 300             # SGLang's kernel as installed
    python tools/bench_sweep.py --plant heads32 --budget 300              # the kernel with a planted fault
    python tools/bench_sweep.py --backend flex --backend aiter_peer_ref   # correct kernels not written here
                                                     # (aiter_peer_ref: REFMLA_AITER_REPO=/path/to/aiter)
    python tools/bench_sweep.py --backend flashmla_peer_ref --layout sparse   # FlashMLA's tests/ref.py
                                                     # (REFMLA_FLASHMLA_REPO=/path/to/FlashMLA)
    python tools/bench_sweep.py --backend vllm_triton --layout block_table  # vLLM's TRITON_MLA over block tables
    python tools/bench_sweep.py --backend triton --layout sparse          # SGLang's DeepSeek-V4 sparse kernel
    python tools/bench_sweep.py --plant tail_block --budget 300           # a fault in a new layout's kernel
    python tools/bench_sweep.py ... --json out.json

``--plant NAME`` runs ``refmla sweep --backend triton`` on SGLang's Triton decode kernel with one
of tests/planted_sweep.py's faults edited into it at run time (each expected under its check), or,
for a plant of tests/planted_layouts.py, the layout's kernel with it (split_floor: vLLM's
TRITON_MLA, ``--layout block_table``; tail_block: SGLang's Triton sparse kernel, ``--layout sparse``);
``aiter_peer_ref`` is aiter's own torch reference loaded from the checkout ``$REFMLA_AITER_REPO``
names, ``aiter_torch_ref`` refmla's rewrite of it (tests/sweep_standins.py); ``flashmla_peer_ref``
FlashMLA's own sparse decode reference, tests/ref.py of the checkout ``$REFMLA_FLASHMLA_REPO`` names
(tools/flashmla_peer.py).
Per backend: cases, cases per minute (of the walk's wall time, which the backends of one run share,
and of the backend's own kernel + reference time), seconds in the kernel's runs (child processes included) and
in the fp64 reference, the control and the comparisons, and every finding with its shrunk case.
On a CPU-only machine the kernels run in the Triton interpreter: these are sweep times, not
kernel performance; say "loaded" when other work shares the machine. The space covered: per
layout the value pairs of the planned space (under the bounds walked, ``--sizes``) the walk covered,
and whether its first points (the largest, the schedule boundaries) were all walked.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from refmla.backends.triton_interp import ensure_interpreter

ensure_interpreter()  # before anything imports triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # planted_sweep, sweep_standins

from refmla.render.sweep import render_sweep  # noqa: E402
from refmla.sweep import SweepConfig, run_sweep  # noqa: E402

STANDINS = {"aiter_torch_ref": "sweep_standins:install", "aiter_peer_ref": "sweep_standins:install",
            "flashmla_peer_ref": "sweep_standins:install_flashmla_peer"}  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", action="append", help="backend (repeatable; default triton)")
    p.add_argument("--plant", help="a fault of tests/planted_sweep.py (SGLang's decode kernel) or tests/planted_layouts.py")
    p.add_argument("--budget", type=float, default=300.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--jobs", type=int, default=1)
    p.add_argument("--layout", action="append")
    p.add_argument("--space", action="append", default=[])
    p.add_argument("--max-shrink", type=int, default=16)
    p.add_argument("--out", default="/tmp/refmla-bench-sweep")
    p.add_argument("--json", help="write the report's JSON here")
    p.add_argument("--sizes", choices=("cpu", "gpu", "production"), help="the bounds walked (default: where it runs)")
    a = p.parse_args()
    import planted_layouts

    layouts = a.layout or list(SweepConfig().layouts)  # refmla sweep's own default: every layout
    backends = a.backend or ["triton"]
    setup = f"planted_sweep:install:{a.plant}" if a.plant else None
    if a.plant in planted_layouts.PLANTS:
        layout = planted_layouts.LAYOUT[a.plant]
        setup, layouts = f"planted_layouts:install:{a.plant}", a.layout or [layout]
        backends = a.backend or ["vllm_triton" if layout == "block_table" else "triton"]
    named = [STANDINS[b] for b in backends if b in STANDINS]
    if len(set(named)) > 1:
        p.error("name the aiter stand-ins and flashmla_peer_ref in separate runs (one setup a run)")
    setup = named[0] if named else setup
    cfg = SweepConfig(backends=backends, budget=a.budget, seed=a.seed, out=a.out, jobs=a.jobs,
                      layouts=layouts, space=a.space, max_shrink=a.max_shrink, setup=setup, sizes=a.sizes)  # fmt: skip
    t0 = time.monotonic()
    rep = run_sweep(cfg)
    print(render_sweep(rep))
    print(f"\nwall {time.monotonic() - t0:.0f} s (walk {rep.walk_seconds:.0f} s, shrink {rep.shrink_seconds:.0f} s)"
          + (f"; planted {a.plant}" if a.plant else ""))  # fmt: skip
    for name, b in rep.backends.items():  # the walk's rate is shared by every backend of the run; its own time is not
        total = b.kernel_seconds + b.reference_seconds
        if b.cases and total:
            print(f"{name}: {b.cases} cases, {60 * b.cases / rep.walk_seconds:.1f} cases/min of the walk, "
                  f"{60 * b.cases / total:.1f} cases/min of its own time; kernel {b.kernel_seconds:.0f} s, "
                  f"reference {b.reference_seconds:.0f} s ({100 * b.reference_seconds / total:.0f}% reference)")
    for layout, (covered, total) in rep.pairs.items():
        walked = sum(c.layout == layout for c in rep.cases)
        print(f"{layout}: {walked} cases, {covered} of {total} value pairs of the planned space "
              f"({100 * covered / total:.0f}%) under {rep.bounds.get('profile')} bounds; "
              f"{rep.not_started.get(layout, 0)} points not started (predicted past the budget)")
    print(f"cut off at the deadline: {rep.cut_off} case(s)")
    if a.json:
        Path(a.json).write_text(json.dumps(rep.to_json(), indent=1) + "\n")
    return rep.exit_code


if __name__ == "__main__":
    sys.exit(main())
