"""refmla: a pure-PyTorch reference and replay harness for absorbed-MLA decode.

Layout (the folder tree is the architecture). A module imports only what is listed above it:
util.py is the bottom of the graph, cli/ the top; ``tests/test_architecture.py`` checks this
order, the hook's boundary and that every package docstring lists its modules. This is the one
copy of the layout (the README links here).

    util.py         small idioms every layer uses (the bottom)
    nearest.py      the pairs of two point sets nearest each other, by one GEMM (the searches' rankings)
    atomic.py       atomic file writes for every writer: refuse non-regular targets, O_TMPFILE, sweep
    signals.py      SIGINT / SIGTERM as exceptions (exit 130 / 143), deferred around a whole write
    progress.py     the progress bar on stderr (batch, disagg)
    schedule.py     SGLang's split-KV schedule (split bounds, num_kv_splits, max_kv_splits)
    arithmetic.py   what a kernel declares of its arithmetic: split schedule, rounding points, lse base
    stores.py       an fp32 result stored in a narrower dtype: to nearest even, toward zero, ... (the control's)
    paged.py        index conventions: SGLang token slots <-> aiter pages
    pool.py         pool rows by their bytes: zero / NaN rows, row-by-row comparison
    scales.py       Scales: the scalars of one call's math, passed whole everywhere
    attended.py     Attended: which pool rows each query row reads (built once per capture)
    blocktable.py   block tables (vLLM, FlashMLA, FlashInfer, CUTLASS, FA3): token rows, consistency
    kernel.py       bring your own kernel: KernelInputs / KernelOutputs / KernelSpec (stable, docs/own-kernel.md)
    capture/        the refmla.capture/1 file: format, validation, read (lazy), write (compacted, atomic)
    region_check.py the MR region-size check: SGLang's clamp and MORI's measured sizes (one table)
    blocked.py      the reference's work in cache-sized blocks under a memory budget, short rows batched
    reference.py    the math, fp64: decode, split-KV partials and merge, extend and verify
    merging.py      split partials merged in fp32: the standard merge and a kernel's other merges
    control.py      the same math at a kernel's rounding points (the tolerance's noise floor)
    compare.py      the one comparator (docs/contract.md section 5) and the one lse rule
    repeat.py       N runs of one kernel on the same inputs, compared bit for bit (nondeterminism)
    options.py      ReplayOptions: every option a replay and its backends read, and their bounds
    results.py      typed results: findings, explanations, backend entries, reports (to_json)
    blame.py        whom a failing backend blames: the failing part's own rows
    checks.py       metadata forensics run before every replay
    plan.py         a kernel's recorded launch plan (aiter's work / reduce maps) checked without running it
    flashmla_plan.py  FlashMLA's recorded tile-scheduler plan checked the same way
    backends/       one module per compute path, picked by name
    isolation.py    each kernel backend in a child process: a crash (signal, GPU fault) is its error
    sparse/         DeepSeek's sparse MLA decode (V3.2 DSA, V4): packed layouts, exact decode, presets, kernel
                    adapters, the sparse-only mistakes (the rest is the one pipeline below)
    indexer/        DeepSeek's lightning indexer (mode indexer): fp64 top-k, the set judge, its mistakes, the
                    check of a sparse decode's indices by the indexer capture beside it
    context.py      what one replay's backends share: reference, control, split references
    hypotheses/     which simple mistake explains a diverging output (section 4), one module per family
    diagnosis.py    which compute path diverges: a class name and a sentence (section 6)
    nextsteps.py    what to do after ``observed``: the captures and commands that tell its causes apart
    splits.py       a kernel's split partials and lse against the split reference
    localize/       where a failing backend goes wrong: requests, heads, positions, split stage
    kvwrite/        the KV cache writer's capture (mode kv_write): documented rows, bit for bit, writer mistakes
    merge/          the merge of attention pieces (mode merge): fp64 merge, merge mistakes, merge kernels
    cp/             decode context parallelism: one step's rank captures as one call (whole-context
                    reference, each rank on its shard, the combine as a merge, the CP mistakes)
    kinds/          what differs between capture kinds (dense, block-table, sparse) behind one interface:
                    reference, control per declared arithmetic, backends, rows, localization, hypotheses
    pipeline.py     the one replay: capture -> backends -> comparison -> ReplayReport, for every kind
    series.py       one layer and rank across decode steps
    chain.py        a decode capture and its step's KV writer capture: the writer's or the contract's part
    batch.py        many captures, serial or in worker processes, with the same result
    inspection.py   `refmla inspect` entries
    diffkv/         prefill vs decode KV rows, bit for bit (transfer fidelity)
    disagg/         `refmla disagg`: diffkv + checks + series + replay per (request, layer, rank)
    synthetic/      synthetic captures with planted faults
    golden/         the golden suite: deterministic cases, build, check
    sweep/          `refmla sweep`: every backend over the production shape space (token slots, verify,
                    block tables, sparse), four checks, shrunk captures
    poolplan.py     the KV buffers a model's SGLang pool registers (the region check before a server starts)
    plots.py        pictures of a replay or a diff-kv (matplotlib, optional)
    render/         text for people: tables, reports, diff-kv and disagg results
    hook/           the capture hooks for a live SGLang or vLLM server (imports only refmla, util.py,
                    schedule.py, blocktable.py, capture/, kvwrite/,
                    merge/, sparse/ and indexer/)
    api.py          the Python API: replay(), synth(), regions(), replay_folder() (what the command line calls)
    cli/            the thin command line, one module per command (the top)
    __main__.py     ``python -m refmla``: the command line

blocktable.py is inside the hook's boundary because it is capture-layer: it sits above capture/,
imports only attended.py and util.py, and capture/ reads and validates block-table captures with
it; the vLLM hook (hook/vllm_extract.py, hook/modes.py) builds token rows from the kernel's block
table and compacts its pages with the same functions the reader checks them with.
"""

__version__ = "0.1.0"
CAPTURE_FORMAT = "refmla.capture/1"
API = ("replay", "synth", "regions", "replay_folder")  # refmla.replay(...) etc.: plain functions of refmla/api.py, loaded on first use


def __getattr__(name: str):
    """``refmla.replay`` / ``synth`` / ``regions``: the functions of refmla.api, without importing it at ``import refmla``."""
    if name in API or name == "api":
        import importlib

        api = importlib.import_module("refmla.api")
        return api if name == "api" else getattr(api, name)
    raise AttributeError(f"module 'refmla' has no attribute {name!r}")
