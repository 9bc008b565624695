"""The example kernel outside refmla (examples/my_kernel) as the tests load it: by path, by
module, through a hand-made entry point, and as copies with one line changed (a planted bug).

The bugs are planted here, in a copy of the example's source, never by refmla: each is one line a
kernel engineer could write, and each replacement must match exactly once.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "my_kernel"
SOURCE = EXAMPLE / "my_kernel" / "decode.py"
SPEC = "my_kernel.decode:decode"
SPARSE_SOURCE = EXAMPLE / "my_kernel" / "sparse.py"
SPARSE_SPEC = "my_kernel.sparse:sparse_decode"
GOLDEN = ROOT / "golden"

# name -> (the line as written, the line with the bug)
BUGS = {
    # a split boundary: a split holding one token (the 33rd of a 33-token request) taken for empty
    "split_boundary": ("        if s * per < L:  # the split holds positions",
                       "        if s * per < L - 1:  # the split holds positions"),
    # an lse base: the final lse stored in log2 units (the softmax runs in base 2)
    "lse_base": ("    tl.store(LSE + r * stride_eb + heads, (m + tl.log2(l)) * LN2, mask=hmask)",
                 "    tl.store(LSE + r * stride_eb + heads, m + tl.log2(l), mask=hmask)"),
    # a page offset: each position's page read from the next block-table entry
    # a causal mask among the drafts forgotten (verify): every query row sees all its request's positions
    "causal": ("    return req.to(torch.int32), (inp.seq_lens.long()[req] - n[req] + i + 1).to(torch.int32)  # causal",
               "    return req.to(torch.int32), inp.seq_lens[req].to(torch.int32)  # causal"),
    "page_offset": ("            entry = pos // P  # the block-table entry of each position",
                    "            entry = pos // P + 1  # the block-table entry of each position"),
}  # fmt: skip
SPARSE_BUGS = {
    # topk_length not read: the stale entries past it (another request's tokens) attended too
    "topk_length": ("        read &= torch.arange(listed.shape[0], device=listed.device) < lengths[b]  # entries past topk_length are stale",
                    "        pass  # entries past topk_length are stale"),
}  # fmt: skip


def planted(bug: str, folder: Path) -> str:
    """A copy of the example's decode.py (sparse.py for a SPARSE_BUGS name) with ``bug`` planted, in
    ``folder``: its ``file.py:function`` name."""
    source, (clean, buggy), fn = (SPARSE_SOURCE, SPARSE_BUGS[bug], "sparse_decode") if bug in SPARSE_BUGS else (
        SOURCE, BUGS[bug], "decode")  # fmt: skip
    text = source.read_text()
    assert text.count(clean) == 1, f"{bug}: the line to change is not in {source} exactly once"
    path = folder / f"{source.stem}_{bug}.py"
    path.write_text(text.replace(clean, buggy))
    return f"{path}:{fn}"


def entry_point_dir(folder: Path, name: str = "my_kernel", value: str = SPEC, more: dict = {}) -> Path:  # noqa: B006
    """A folder holding a hand-made ``my_kernel-0.1.0.dist-info`` with ``name = value`` (and ``more``)
    in the group ``refmla.backends``: on sys.path, importlib.metadata finds it as an installed package's."""
    info = folder / "my_kernel-0.1.0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: my-kernel\nVersion: 0.1.0\n")
    lines = "".join(f"{n} = {v}\n" for n, v in {name: value, **more}.items())
    (info / "entry_points.txt").write_text(f"[refmla.backends]\n{lines}")
    return folder


def cli(*args: str, path: tuple = (), timeout: float = 900) -> subprocess.CompletedProcess:
    """``python -m refmla ARGS`` with this tree, the example's folder and ``path`` on PYTHONPATH, on the CPU."""
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="", REFMLA_ISOLATE="1")  # as a user runs it
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(EXAMPLE), *map(str, path)])
    return subprocess.run([sys.executable, "-m", "refmla", *args], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=ROOT)  # fmt: skip
