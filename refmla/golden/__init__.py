"""Golden files: inputs and the fp64 reference frozen per case, for regression-testing MLA kernels.

    case (GoldenCase) --build--> <case>.safetensors (refmla.capture/1) + manifest.json
    golden file + backend name --check--> GoldenResult (replay's comparator and split check)

Layout (imports run down this list, never up):
    determinism.py  integer-only deterministic numbers: splitmix64, grid_normal, NaN bits, shuffles
    cases.py        GoldenCase (a case says its mode) and the quick / full suites
    build.py        a builder per mode: inputs, fp64 reference, meta; write_case, generate, load_manifest
    result.py       GoldenResult: the typed BackendEntry, its message, its JSON across processes
    check.py        check / self_check against a golden file (GoldenContext: the stored reference)
    isolate.py      check_isolated (a child process) and needs_isolation
    __main__.py     ``python -m refmla.golden check FILE --backend NAME``, what check_isolated runs
    sparse.py       the sparse decode goldens (golden/sparse/: DeepSeek-V4-Flash C4 / C128, V3.2 DSA) and their check
    indexer.py      the indexer goldens (golden/indexer/: V3.2 fp8, V3.2 bf16, V4 C4) and their check
    dcp.py          the context-parallel goldens (golden/dcp/<case>/: one DCP-2 step's rank captures) and their
                    check (each rank's kernel, the combine, judged as `refmla replay FOLDER` judges a step)
    suite.py      `golden generate`: all four written as one suite (targets checked first, manifests last, restored if cut)

docs/golden.md says what a golden file holds, why the bytes are deterministic and how to run the
kernel-regression suite (tests/kernel_regression).
"""

from refmla.golden.build import (
    BUILDERS,
    GENERATOR,
    MANIFEST,
    Builder,
    build_inputs,
    build_tensors,
    case_meta,
    generate,
    load_manifest,
    reference_tensors,
    split_width,
    write_case,
)
from refmla.golden.cases import FULL_ONLY, INT32_POOL_ROWS, MODES, NO_MSCALE_SCALE, QUICK, SUITES, GoldenCase
from refmla.golden.check import (
    CHECK_BACKENDS,
    GoldenContext,
    backend_applies,
    check,
    inputs_only,
    materialize_pool,
    replay_command,
    self_check,
)
from refmla.golden.determinism import (
    DTYPES,
    NAN_BITS,
    PRECISION,
    counter_hash,
    grid_normal,
    nan_filled,
    shuffled,
    splitmix64,
)
from refmla.golden.isolate import check_isolated, golden_meta, needs_isolation
from refmla.golden.result import GoldenResult

__all__ = [
    "BUILDERS", "CHECK_BACKENDS", "DTYPES", "FULL_ONLY", "GENERATOR", "INT32_POOL_ROWS", "MANIFEST", "MODES",
    "NAN_BITS", "NO_MSCALE_SCALE", "PRECISION", "QUICK", "SUITES",
    "Builder", "GoldenCase", "GoldenContext", "GoldenResult",
    "backend_applies", "build_inputs", "build_tensors", "case_meta", "check", "check_isolated", "counter_hash", "generate",
    "golden_meta", "grid_normal", "inputs_only", "load_manifest", "materialize_pool", "nan_filled",
    "needs_isolation", "reference_tensors", "replay_command", "self_check", "shuffled", "split_width",
    "splitmix64", "write_case",
]  # fmt: skip
