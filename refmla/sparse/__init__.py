"""DeepSeek's sparse MLA decode (V3.2 DSA; V4 with a window cache and a compressed cache, packed
fp8 layouts, a per-head attention sink): what is its own. Reading, replaying, judging, diagnosing,
rendering and the goldens are the one pipeline every capture kind takes (refmla.pipeline,
refmla.diagnosis, refmla.render, refmla.golden.sparse); a sparse capture enters it as an
``Attended.sparse_topk`` of one or two pools.

Modules, imports going down this list:

    layouts.py     the packed layouts (v32: 656 bytes, v4 "MODEL1": 584), exact fp64 decode, a quantizer
    format.py      the sparse decode capture: tensors, meta (mode sparse_decode), SparseCapture
    validation.py  every inconsistency, one line each; the file read / written (validated, atomic); NaN inputs
    arithmetic.py  what each sparse kernel declares of its rounding (read from its source): its control's
    rows.py        what each query row reads: both caches' valid entries (the Attended seam's sparse_topk)
    reference.py   the math in fp64 in blocks of rows, the inverse rope, the control at a kernel's declared
                   rounding points, and both judged with the one comparator
    presets.py     DeepSeek-V4-Flash TP8 (C4, C128, window; the model's per-layer ratios) and V3.2 TP8 shapes
    synth.py       synthetic calls with hostile data (shuffled pages, stale tails, NaN garbage, clamped lengths)
    byte_faults.py the planted keys of a cache read another way (fp8 encoding, page stride, V3.2's fp32 scales)
    faults.py      production's output with a planted fault: its own plain loop, never the reference
    make.py        `refmla synth OUT --preset deepseek-v4-flash-tp8 [--fault NAME]`
    backends.py    the kernel adapters by name: triton (SGLang's), aiter_sparse, tilelang, flashmla_sparse (and
                   observed), each with the arithmetic it is judged at, each a Backend (SparseBackend)
    readings.py    a cache's bytes read another way: fp8 encoding, V3.2's fp32 tile scales as bf16 / UE8M0,
                   page stride (the kv_bytes candidates)
    kernel.py      a sparse top-k kernel outside refmla (refmla.kernel, layout sparse_topk) as a path: its
                   inputs (the caches as stored and decoded, the top-k indices), its outputs checked
    misplaced.py   rows written to another request's row, one entry read at the neighbouring slot
    hypotheses.py  the sparse-only mistakes (sink, topk_length, -1 as slot 0, the compressed cache,
                   window edges, per-tile UE8M0 scales on either cache, rope bytes) and the shared ones
                   (wrong_sm_scale, the misplaced) that explain a diverging output
    inspection.py  the description `refmla inspect` gives of a sparse capture: layout, packing, caches, top-k
"""
