"""refmla: a pure-PyTorch reference and replay harness for absorbed-MLA decode.

Layout (the folder tree is the architecture):
    reference.py   the math: decode / split / extend / low-precision control, fp64
    paged.py       index conventions (SGLang token slots <-> aiter pages)
    capture.py     the refmla.capture/1 file: read (validated, lazy) and write (compacted, atomic)
    checks.py      metadata forensics run before every replay
    compare.py     the one comparator (contract section 5)
    backends/      one module per compute path, picked by name
    replay.py      capture -> backends -> comparison -> report
    explain.py     hypotheses for a diverging output (contract section 4) and the diagnosis
    synth.py       synthetic captures with planted faults
    cli.py         the thin command line
"""

__version__ = "0.1.0"
CAPTURE_FORMAT = "refmla.capture/1"
