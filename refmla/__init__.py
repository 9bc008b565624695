"""refmla: a pure-PyTorch reference and replay harness for absorbed-MLA decode.

Layout (the folder tree is the architecture):
    reference.py   the math: decode / split / extend / low-precision control, fp64
    paged.py       index conventions (SGLang token slots <-> aiter pages)
    capture/       the refmla.capture/1 file: read (validated, lazy) and write (compacted, atomic)
    checks.py      metadata forensics run before every replay
    compare.py     the one comparator (contract section 5)
    backends/      one module per compute path, picked by name
    replay.py      capture -> backends -> comparison -> report
    hypotheses.py  which simple mistake explains a diverging output (contract section 4)
    diagnosis.py   which compute path diverges: a machine name and a sentence
    diffkv.py      prefill vs decode KV rows, bit for bit (transfer fidelity)
    series.py      many captures: parallel replay, series checks, summary table
    plots.py       pictures of a replay or a diff-kv (matplotlib, optional)
    golden.py      the golden suite generator
    synth.py       synthetic captures with planted faults
    hook/          the capture hook for a live SGLang server
    cli.py         the thin command line
"""

__version__ = "0.1.0"
CAPTURE_FORMAT = "refmla.capture/1"
