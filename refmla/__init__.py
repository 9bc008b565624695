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
    paged.py        index conventions: SGLang token slots <-> aiter pages
    pool.py         pool rows by their bytes: zero / NaN rows, row-by-row comparison
    scales.py       Scales: the scalars of one call's math, passed whole everywhere
    attended.py     Attended: which pool rows each query row reads (built once per capture)
    blocktable.py   block tables (vLLM, FlashMLA, FlashInfer, CUTLASS, FA3): token rows, consistency
    capture/        the refmla.capture/1 file: format, validation, read (lazy), write (compacted, atomic)
    regions.py      the MR region-size check of a capture's pool geometry (meta only)
    blocked.py      the reference's work in cache-sized blocks under a memory budget, short rows batched
    reference.py    the math, fp64: decode, split-KV partials and merge, extend and verify
    control.py      the same math at a kernel's rounding points (the tolerance's noise floor)
    compare.py      the one comparator (docs/contract.md section 5) and the one lse rule
    options.py      ReplayOptions: every option a replay and its backends read, and their bounds
    results.py      typed results: findings, explanations, backend entries, reports (to_json)
    blame.py        whom a failing backend blames: the failing part's own rows
    checks.py       metadata forensics run before every replay
    backends/       one module per compute path, picked by name
    isolation.py    each kernel backend in a child process: a crash (signal, GPU fault) is its error
    sparse/         DeepSeek's sparse MLA decode (V3.2 DSA, V4): packed layouts, exact decode, presets, kernel
                    adapters, the sparse-only mistakes (the rest is the one pipeline below)
    context.py      what one replay's backends share: reference, control, split references
    hypotheses/     which simple mistake explains a diverging output (section 4), one module per family
    diagnosis.py    which compute path diverges: a class name and a sentence (section 6)
    splits.py       a kernel's split partials and lse against the split reference
    localize/       where a failing backend goes wrong: requests, heads, positions, split stage
    replay.py       capture -> backends -> comparison -> ReplayReport
    series.py       one layer and rank across decode steps
    batch.py        many captures, serial or in worker processes, with the same result
    inspection.py   `refmla inspect` entries
    diffkv/         prefill vs decode KV rows, bit for bit (transfer fidelity)
    disagg/         `refmla disagg`: diffkv + checks + series + replay per (request, layer, rank)
    synth/          synthetic captures with planted faults
    golden/         the golden suite: deterministic cases, build, check
    plots.py        pictures of a replay or a diff-kv (matplotlib, optional)
    render/         text for people: tables, reports, diff-kv and disagg results
    hook/           the capture hooks for a live SGLang or vLLM server (imports only refmla, util.py,
                    schedule.py, blocktable.py, capture/ and sparse/)
    cli/            the thin command line, one module per command (the top)
    __main__.py     ``python -m refmla``: the command line

blocktable.py is inside the hook's boundary because it is capture-layer: it sits above capture/,
imports only attended.py and util.py, and capture/ reads and validates block-table captures with
it; the vLLM hook (hook/vllm_extract.py, hook/modes.py) builds token rows from the kernel's block
table and compacts its pages with the same functions the reader checks them with.
"""

__version__ = "0.1.0"
CAPTURE_FORMAT = "refmla.capture/1"
