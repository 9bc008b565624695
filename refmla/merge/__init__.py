"""The merges that join attention computed in pieces (meta ``mode`` ``merge``): chunked-prefix
prefill's per-chunk partials, decode context parallelism's per-rank partials.

Modules, imports going down this list:

    format.py      the capture: tensors, meta (lse_base), MergeCapture, empty pieces, validation
    io.py          read / write (refmla.capture.kinds: lazy, validated, atomic)
    reference.py   the merge in fp64 (the reference) and fp32 (the control), one function
    hypotheses.py  which merge mistake reproduces the output (lse base, empty piece, dropped, layout)
    backends.py    the merge kernels by name: vLLM's and SGLang's Triton merges, interpreted on a CPU
    judge.py       each path compared, explained -> ReplayReport
    synth.py       synthetic merges with planted faults, by their own plain loop
"""
