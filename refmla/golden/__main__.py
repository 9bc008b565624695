"""``python -m refmla.golden check FILE --backend NAME``: one check, its result as JSON on stdout.

What :func:`refmla.golden.isolate.check_isolated` runs in a child process, and the command a
``pool_base_row`` case's failure message gives for replaying it.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Optional, Sequence

from refmla.backends.triton_interp import ensure_interpreter
from refmla.golden.check import check
from refmla.util import json_safe


def main(argv: Optional[Sequence[str]] = None) -> int:
    ensure_interpreter()  # where there is no GPU; before anything imports triton
    p = argparse.ArgumentParser(prog="python -m refmla.golden")
    p.add_argument("command", choices=["check"])
    p.add_argument("path")
    p.add_argument("--backend", required=True)
    a = p.parse_args(argv)
    r = check(a.path, a.backend)
    print(json.dumps(json_safe(r.to_json()), default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
