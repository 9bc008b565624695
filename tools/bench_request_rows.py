"""What the hook's ForwardBatch.init_new wrapper costs per forward (refmla.hook.requests.record): a batch of
N requests already remembered (every decode step after the first) and seen for the first time.

    python tools/bench_request_rows.py [N]
"""

from __future__ import annotations

import sys
import timeit
from types import SimpleNamespace

from refmla.hook.requests import RequestTable, record


class Req:  # the attributes record reads of SGLang's Req
    def __init__(self, i: int):
        self.rid, self.origin_input_ids, self.output_ids = f"req-{i}", list(range(4000)), [1] * 100
        self.cached_tokens_device, self.cached_tokens_host, self.cached_tokens_storage = 64, 0, 0


def main(n: int = 256) -> None:
    batch, table = SimpleNamespace(reqs=[Req(i) for i in range(n)]), RequestTable()
    record(batch, table)
    known = timeit.timeit(lambda: record(batch, table), number=2000) / 2000
    fresh = timeit.timeit(lambda: (table.clear(), record(batch, table)), number=200) / 200
    print(f"{n} requests: {known * 1e6:.0f} us per forward when known, {fresh * 1e6:.0f} us at first sight")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 256)
