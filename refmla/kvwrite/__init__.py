"""The KV cache writer, checked before any kernel reads what it wrote (meta ``mode`` ``kv_write``).

Modules, imports going down this list:

    packed.py      DeepSeek-V4's packed pages (meta kv_layout v4): the inputs' checks, a token's bytes,
                   the UE8M0 tile quantization exactly (the layout decoded by refmla.sparse.layouts)
    format.py      the capture: tensors, meta, KvWriteCapture and its validation (file + key on error)
    io.py          read / write (refmla.capture.kinds: lazy, validated, atomic)
    reference.py   the documented rows, exactly: bf16 cast, fp8 x / scale saturated, round to nearest even
    encoding.py    the bytes' fp8 encoding, torch's cast past the range, another scale: the writer
                   reference re-run the other way (kv_fp8_encoding_mismatch, kv_cast_overflow, ...)
    hypotheses.py  which writer mistake reproduces the differing rows bit for bit
    packed_hypotheses.py  the packed writer's: a tile's exponent off, the scale not applied, the rope
                   bytes elsewhere (and the shared row-to-other-slot / neighbour mechanisms)
    judge.py       the rows compared, explained -> ReplayReport
    packed_synth.py  synthetic packed writer calls (V4 pages) with planted faults, their own loop
    synth.py       synthetic writer calls with planted faults, by their own plain loop (both layouts)
"""
