"""`refmla doctor [--json]`: which backends are usable here, with versions and why not, and the
engine and kernel each one runs (refmla.backends.engines); an installed package's kernels (entry
points of ``refmla.backends``, docs/own-kernel.md) follow refmla's own dense backends."""

from __future__ import annotations

import os
import platform

import torch

from refmla.backends import ALL_NAMES, get_backend, is_sparse_kernel, plugin_defaults
from refmla.backends.named import entry_point_of
from refmla.backends.engines import KERNELS, package_versions
from refmla.cli.common import EXIT_OK, print_json
from refmla.indexer.backends import KERNELS as INDEXER_KERNELS
from refmla.indexer.backends import availability as indexer_availability
from refmla.merge.backends import KERNELS as MERGE_KERNELS
from refmla.merge.backends import availability as merge_availability
from refmla.sparse.backends import KERNELS as SPARSE_KERNELS
from refmla.sparse.backends import availability as sparse_availability

SPARSE_ENGINES = {"triton": ("sglang", "triton_fp8_attention_fwd (dsv4 triton_sparse_decode)"),
                  "aiter_sparse": ("aiter", "pa_decode_sparse via sglang aiter_sparse_decode_fwd"),
                  "tilelang": ("sglang", "dpsk_v4_fp8_attention_fwd (tilelang)"),
                  "flashmla_sparse": ("flashmla", "flash_mla_with_kvcache with indices")}  # fmt: skip


def add_parser(sub) -> None:
    dr = sub.add_parser("doctor", help="which backends are usable here, with versions and why not")
    dr.add_argument("--json", action="store_true")
    dr.set_defaults(func=doctor)


def doctor(args) -> int:
    rows = []
    for name in ALL_NAMES:
        ok, why = get_backend(name).availability()
        of = KERNELS.get(name)
        rows.append({"backend": name, "usable": ok, "detail": why, "engine": of.engine if of else None,
                     "kernel": of.kernel if of else None, "kind": "dense"})  # fmt: skip
    for name in plugin_defaults():  # the installed packages' kernels (entry points of refmla.backends)
        ok, why = get_backend(name).availability()
        dist, value = entry_point_of(name)
        kind = "sparse_decode" if is_sparse_kernel(name) else "dense"  # a sparse top-k kernel (layout sparse_topk)
        rows.append({"backend": name, "usable": ok, "detail": why, "engine": dist, "kernel": value, "kind": kind,
                     "entry_point": True})  # fmt: skip
    for name in SPARSE_KERNELS:  # the sparse decode kernels (DeepSeek V3.2 / V4 captures)
        ok, why = sparse_availability(name)
        engine, kernel = SPARSE_ENGINES[name]
        rows.append({"backend": name, "usable": ok, "detail": why, "engine": engine, "kernel": kernel, "kind": "sparse_decode"})
    for name, (engine, _, kernel) in MERGE_KERNELS.items():  # the state merges (merge / chunked-prefill captures)
        ok, why = merge_availability(name)
        rows.append({"backend": name, "usable": ok, "detail": why, "engine": engine, "kernel": kernel, "kind": "merge"})
    for name, (engine, kernel) in INDEXER_KERNELS.items():  # the engines' indexer code (indexer captures)
        ok, why = indexer_availability(name)
        rows.append({"backend": name, "usable": ok, "detail": why, "engine": engine, "kernel": kernel, "kind": "indexer"})
    if args.json:
        print_json(rows)
        return EXIT_OK
    gpu = "yes: " + torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no"
    print(f"python {platform.python_version()}  torch {torch.__version__}  gpu {gpu}  "
          f"TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '')}")  # fmt: skip
    print("engines and kernel packages: " + ", ".join(f"{k} {v}" for k, v in package_versions().items()))
    suffix = {"sparse_decode": " (sparse)", "merge": " (merge)", "indexer": " (indexer)"}
    label = {id(r): r["backend"] + suffix.get(r["kind"], "") for r in rows}
    width = max(len(v) for v in label.values())
    for r in rows:
        print(f"  {label[id(r)]:<{width}} {'usable' if r['usable'] else 'unavailable':<12} "
              f"[{r['engine']}: {r['kernel']}] {r['detail']}")  # fmt: skip
    return EXIT_OK
