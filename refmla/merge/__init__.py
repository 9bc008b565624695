"""The merges that join attention computed in pieces (meta ``mode`` ``merge``): chunked-prefix
prefill's per-chunk partials, decode context parallelism's per-rank partials; and the chunked-prefix
prefill whole (mode ``chunked_prefill``): its pieces' attention over their keys, its merges, the row.

Modules, imports going down this list:

    format.py             the capture: tensors, meta (lse_base), MergeCapture, empty pieces, validation
    chunked_format.py     the chunked-prefill capture: q, each piece's keys / values / (out, lse), each
                          merge, the per-request layout; ChunkedCapture, validation, description
    io.py                 read / write both kinds (refmla.capture.kinds: lazy, validated, atomic)
    reference.py          the merge in fp64 (the reference) and fp32 (the control), one function
    mha.py                a piece's MHA attention in fp64 and at the kernel's rounding points, the
                          whole row, the chained control of the merged output
    hypotheses.py         which merge mistake reproduces the output (lse base, empty piece, dropped, layout)
    chunked_hypotheses.py which attention mistake reproduces a piece (lse base, keys missing, other keys, mask)
    backends.py           the merge kernels by name: vLLM's and SGLang's Triton merges, interpreted on a CPU
    judge.py              each path compared, explained -> ReplayReport
    chunked_judge.py      a chunked prefill link by link: whole row, each piece, each merge -> ReplayReport
    synth.py              synthetic merges with planted faults, by their own plain loop
    chunked_synth.py      synthetic chunked prefills with planted faults, by their own plain loop
"""
