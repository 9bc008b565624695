"""The KV cache writer, checked before any kernel reads what it wrote (meta ``mode`` ``kv_write``).

Modules, imports going down this list:

    format.py      the capture: tensors, meta, KvWriteCapture and its validation (file + key on error)
    io.py          read / write (refmla.capture.kinds: lazy, validated, atomic)
    reference.py   the documented rows, exactly: bf16 cast, fp8 x / scale saturated, round to nearest even
    hypotheses.py  which writer mistake reproduces the differing rows bit for bit
    judge.py       the rows compared, explained -> ReplayReport
    synth.py       synthetic writer calls with planted faults, by their own plain loop
"""
