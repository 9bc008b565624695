"""DeepSeek's sparse MLA decode (V3.2 DSA; V4 with a window cache and a compressed cache, packed
fp8 layouts, a per-head attention sink): its capture format, fp64 reference, replay and faults.

Modules, imports going down this list:

    layouts.py     the packed layouts (v32: 656 bytes, v4 "MODEL1": 584), exact fp64 decode, a quantizer
    format.py      the sparse decode capture: tensors, meta (mode sparse_decode), SparseCapture
    validation.py  every inconsistency, one line each (an index past its cache, a length past the width, ...)
    io.py          read / write (atomic, validated), telling a sparse capture file from a dense one
    rows.py        what each query row reads: both caches' valid entries (the Attended seam's sparse_topk)
    reference.py   the math in fp64, the inverse rope, and the control at the kernels' rounding points
    presets.py     DeepSeek-V4-Flash TP8 (C4, C128, window; the model's per-layer ratios) and V3.2 TP8 shapes
    synth.py       synthetic calls with hostile data (shuffled pages, stale tails, NaN garbage, clamped lengths)
    faults.py      production's output with a planted fault: its own plain loop, never the reference
    make.py        `refmla synth OUT --preset deepseek-v4-flash-tp8 [--fault NAME]`
    backends.py    the paths by name: reference, observed, triton (SGLang's), aiter_sparse, tilelang
    judge.py       the one comparator on sparse outputs, and the lse
    hypotheses.py  which sparse mistake explains a diverging output (with its detail)
    diagnosis.py   which path diverges: the dense Diagnosis (same classes and JSON keys), sparse sentences
    replay.py      capture -> paths -> judged, explained -> SparseReport
    inspection.py  `refmla inspect` of a sparse capture: layout, packing, caches' geometry, top-k, ratio, regions
    render.py      the report and the inspect description as text
    golden.py      the sparse golden cases (golden/sparse/) and their check
"""
