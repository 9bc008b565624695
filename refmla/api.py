"""The Python API: what the command line calls, for a notebook or a script.

    refmla.replay(path_or_capture, backends=None, tol=None, **options) -> ReplayReport
                    (backends: names, or {"mine": kernel} of refmla.kernel's interface)
    refmla.replay_folder(folder_or_paths, backends=None, tol=None, jobs=1, **options) -> [ReplayReport]
                    (every capture of a folder, then linked across: a decode and its step's KV
                    writer, a writer and another layer's, rows written through a stale slot mapping)
    refmla.synth(out, preset_name="kimi-k2-tp8", fault="none", seed=None, layer=None) -> dict (what was planted)
                    (every kind: dense, verify, sparse, kv_write, merge, chunked_prefill presets;
                    kimi-k2-tp8-dcp2 / -dcp4: a folder of one DCP step's rank captures)
    refmla.regions(capture=None, model=None, config=None, tokens=None, ...) -> RegionCheck
    refmla.api.unrun_backends(report, asked) -> [(backend, reason)]: backends asked for that did not run

``refmla.replay`` / ``refmla.synth`` / ``refmla.regions`` are these functions (the package's
``__getattr__`` hands them out, so ``import refmla`` loads none of this until first used). Bad input raises :class:`ValueError` (or
refmla.capture.CaptureError, a ValueError) with the one line the CLI prints.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence, Union

from refmla.backends import ALL_NAMES
from refmla.backends.named import register, unregister
from refmla.capture import Capture, CaptureError, read_capture
from refmla.compare import Tolerance
from refmla.hook.geometry import MORI_ENV
from refmla.options import ReplayOptions
from refmla.sparse.validation import is_sparse_file, read_sparse
from refmla.poolplan import KV_DTYPES, MODELS, buffers, geometry_from_config, model_geometry
from refmla.region_check import PoolMeta, RegionCheck, check_region, plan_regions
from refmla.pipeline import replay_capture, replay_file
from refmla.cp.replay import group_steps, replay_step_files
from refmla.results import ReplayReport
from refmla.kvwrite.synth import PRESETS as KV_WRITE_PRESETS
from refmla.indexer.synth import PRESETS as INDEXER_PRESETS
from refmla.indexer.synth import synth_indexer
from refmla.kvwrite.synth import synth_kv_write
from refmla.merge.chunked_synth import PRESETS as CHUNKED_PRESETS
from refmla.merge.chunked_synth import synth_chunked
from refmla.merge.synth import PRESETS as MERGE_PRESETS
from refmla.merge.synth import synth_merge
from refmla.sparse.faults import FAULTS as SPARSE_FAULTS
from refmla.sparse.make import synth_sparse
from refmla.sparse.presets import PRESETS as SPARSE_PRESETS
from refmla.synthetic import FAULTS, PRESETS, synth_capture
from refmla.synthetic.dcp import PRESETS as DCP_PRESETS
from refmla.synthetic.dcp import synth_dcp
from refmla.synthetic import preset as dense_preset
from refmla.util import first_line

KIND_SYNTHS = {**{p: synth_kv_write for p in KV_WRITE_PRESETS}, **{p: synth_merge for p in MERGE_PRESETS},
               **{p: synth_dcp for p in DCP_PRESETS},
               **{p: synth_chunked for p in CHUNKED_PRESETS}, **{p: synth_indexer for p in INDEXER_PRESETS}}  # fmt: skip  # each checks its own faults
ALL_PRESETS = [*PRESETS, *SPARSE_PRESETS, *KIND_SYNTHS]
TRANSFER_BACKENDS = ("mori", "mooncake", "nixl", "ascend", "fake")


def replay(path_or_capture: Union[str, Path, Capture],
           backends: Union[Sequence[str], Mapping[str, Callable], None] = None,
           tol: Optional[Tolerance] = None, **options: Any) -> ReplayReport:  # fmt: skip
    """One capture (a path, or a Capture already read) through ``backends`` (None: every backend
    usable here), judged with ``tol``; ``options``: the other ReplayOptions fields (device,
    cu_count, explain, ...). Every kind (dense, block-table, verify, sparse decode, kv_write, merge);
    a folder of one decode-context-parallel step's rank captures is that step judged as one call
    (kind ``context_parallel``, docs/context-parallel.md).

    ``backends`` names backends (refmla's own, ``"module:function"``, an installed package's
    kernel), or maps names to kernels of refmla.kernel's interface, ``{"mine": decode}`` (docs/own-kernel.md),
    registered under those names for this call. A callable that does not meet the interface
    raises refmla.kernel.InterfaceError (a ValueError).
    A capture that cannot be read or is invalid (what the command line reports as ``invalid``, exit
    2) raises :class:`~refmla.capture.CaptureError`, a ValueError, with the line the command line prints."""
    tol = tol or Tolerance()
    if isinstance(backends, Mapping):
        with registered(backends):
            return replay(path_or_capture, list(backends), tol, **options)
    opts = ReplayOptions(backends=list(backends) if backends else None, tol=tol, **options)
    opts.check()
    if isinstance(path_or_capture, Capture):
        report = replay_capture(path_or_capture, opts)
    elif _is_dir(path_or_capture):
        report = _replay_step(Path(path_or_capture), opts)
    else:
        report = replay_file(path_or_capture, opts)
    if report.verdict == "invalid":  # bad input raises, with the line the command line prints
        raise CaptureError.of_line(report.capture, first_line(report.error or "; ".join(report.metadata.errors)))
    return report


def replay_folder(folder_or_paths: Union[str, Path, Sequence[Union[str, Path]]],
                  backends: Optional[Sequence[str]] = None, tol: Optional[Tolerance] = None, jobs: int = 1,
                  **options: Any) -> list[ReplayReport]:  # fmt: skip
    """Every capture of a folder (its ``*.safetensors``, recursively, sorted), or of the paths given,
    replayed as ``refmla replay DIR`` does: the series checks across steps and the links across
    captures (refmla.chain.link: the writer's or the contract's part of a decode's divergence,
    another layer's buffer, stale rows). A capture that cannot be read is a report with verdict
    ``invalid`` here (the others are still replayed), as on the command line. A folder holding no
    capture raises ValueError. The DCP rank captures of one step are one report, as on the command
    line."""
    from refmla.batch import WithSteps, replay_many
    from refmla.chain import link
    from refmla.cp.replay import KIND as CP_KIND
    from refmla.series import attach_series

    given = [folder_or_paths] if isinstance(folder_or_paths, (str, Path)) else list(folder_or_paths)
    paths: list[str] = []
    origins: list[str] = []
    for p in map(Path, given):
        if p.is_dir():
            found = sorted(str(f) for f in p.rglob("*.safetensors") if not f.is_dir())
            if not found:
                raise ValueError(f"{p}: directory holds no *.safetensors captures")
        else:
            found = [str(p)]
        paths, origins = paths + found, origins + [str(p)] * len(found)
    units, steps = group_steps(paths, origins)  # the DCP ranks of one step: one report (refmla.cp.replay)
    opts = ReplayOptions(backends=list(backends) if backends else None, tol=tol or Tolerance(), **options)
    opts.check()
    reports = replay_many(units, opts, jobs=jobs, task=WithSteps(steps) if steps else None)
    per_capture = [r for r in reports if r.kind != CP_KIND]  # a step of ranks has no series of its own
    if len(per_capture) > 1:
        with contextlib.suppress(Exception):  # an aid across captures: never the cost of the reports
            attach_series(per_capture, opts)
        link(per_capture)
    return reports


def _is_dir(path: Any) -> bool:
    try:
        return Path(path).is_dir()
    except (OSError, ValueError):  # a name too long, a NUL: not a folder (replay_file says why)
        return False


def _replay_step(folder: Path, opts: ReplayOptions) -> ReplayReport:
    """A folder of one context-parallel step's rank captures, judged as one call (refmla.cp.replay);
    a folder holding anything else, or several steps, is a ValueError naming it."""
    files = sorted(str(f) for f in folder.rglob("*.safetensors") if f.is_file())
    units, steps = group_steps(files, [str(folder)] * len(files))
    if len(units) != 1 or units[0] not in steps:
        raise ValueError(f"{folder}: a folder replays here only when it holds the DCP rank captures of one step "
                         f"({len(steps)} step(s) and {len(units) - len(steps)} other capture(s) found); "
                         "give the capture files, or use the command line for many")  # fmt: skip
    return replay_step_files(units[0], steps[units[0]], opts)


@contextlib.contextmanager
def registered(kernels: Mapping[str, Callable]) -> Iterator[None]:
    """``kernels`` (name -> callable of refmla.kernel's interface) as backends within the block; a
    callable under a name refmla already has (``triton``) is refused: ValueError."""
    taken = [n for n in kernels if n in ALL_NAMES or n in ("reference", "observed")]
    if taken:
        raise ValueError(f"backends={{{taken[0]!r}: ...}}: {taken[0]} is a backend of refmla's own; name your kernel otherwise")
    for name, fn in kernels.items():
        if isinstance(fn, str):
            raise ValueError(f"backends={{{name!r}: {fn!r}}}: give a callable, or pass names as a list")
        register(name, fn)  # its signature checked: InterfaceError
    try:
        yield
    finally:
        for name in kernels:
            unregister(name)


def unrun_backends(report: Any, asked: Sequence[str]) -> list[tuple[str, str]]:
    """(backend, reason) for each backend in ``asked`` the report holds as skipped (it did not run)."""
    named = list(report.backends.items())  # a ReplayReport: name -> BackendEntry
    return [(n, e.reason or "skipped") for n, e in named
            if n in asked and e.status == "skipped"]  # fmt: skip


def synth(out: Union[str, Path], preset_name: str = "kimi-k2-tp8", fault: str = "none", seed: Optional[int] = None,
          layer: Optional[int] = None) -> dict:
    """Write a synthetic capture of preset ``preset_name`` to ``out``; returns what was planted. A
    DeepSeek-V4 / V3.2 preset writes a sparse decode capture (``layer``: that layer of the model); a
    kv-write-*, merge-* or chunked-prefill* preset a KV writer, merge or chunked-prefill capture."""
    if preset_name not in ALL_PRESETS:
        raise ValueError(f"unknown preset {preset_name!r}; choose from {', '.join(ALL_PRESETS)}")
    if layer is not None and preset_name not in SPARSE_PRESETS:
        raise ValueError(f"layer applies to the sparse presets ({', '.join(SPARSE_PRESETS)}), not {preset_name!r}")
    if preset_name in KIND_SYNTHS:
        return KIND_SYNTHS[preset_name](out, preset_name, fault, seed=seed or 0)
    if preset_name in SPARSE_PRESETS:
        if fault not in ("none", *SPARSE_FAULTS):
            raise ValueError(f"unknown fault {fault!r} for a sparse preset; choose from none, {', '.join(SPARSE_FAULTS)}")
        return synth_sparse(out, preset_name, None if fault == "none" else fault, seed, layer=layer)
    if fault not in FAULTS:
        raise ValueError(f"unknown fault {fault!r}; choose from {', '.join(FAULTS)}")
    spec = dense_preset(preset_name, seed=seed) if seed is not None else dense_preset(preset_name)
    return synth_capture(out, spec, fault)


def env_clamp() -> Optional[int]:
    """SGLANG_MORI_MAX_MR_BYTES from the environment (None: unset); a bad value raises ValueError naming it."""
    raw = os.environ.get(MORI_ENV, "").strip()
    if not raw:
        return None
    try:
        value = int(float(raw))
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{MORI_ENV}={raw!r}: must be a number of bytes >= 1")
    return value


def regions(capture: Union[str, Path, None] = None, model: Optional[str] = None, config: Optional[str] = None,
            tokens: Optional[int] = None, page_size: Optional[int] = None, kv_dtype: str = "bf16", tp: int = 1,
            transfer_backend: str = "mori", clamp: Optional[int] = None) -> RegionCheck:
    """The region check: of a capture's recorded pool, or of a model's pool of ``tokens``
    (max_total_num_tokens) before a server starts. ``clamp``: SGLANG_MORI_MAX_MR_BYTES (None: the
    environment's, else 2 GiB). ``tp`` is recorded only: MLA's KV is replicated on every rank."""
    if capture is not None:
        if model or config or tokens is not None:
            raise ValueError("give a capture, or --model / --config with --tokens, not both")
        if is_sparse_file(capture):
            return read_sparse(capture).region()
        meta = read_capture(capture).meta
        return check_region(meta if clamp is None else PoolMeta.from_raw({**meta.to_json(), "mori_max_mr_bytes": clamp}))
    if (model is None) == (config is None):
        raise ValueError(f"name a model (--model {' | '.join(MODELS)}) or a config (--config config.json), one of them")
    if tokens is None or tokens < 1:
        raise ValueError(f"--tokens: max_total_num_tokens must be an int >= 1 (got {tokens!r})")
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"--kv-dtype {kv_dtype!r}: choose from {', '.join(KV_DTYPES)}")
    if page_size is not None and page_size < 1 or tp < 1:
        raise ValueError("--page-size and --tp must be >= 1")
    try:
        geometry = model_geometry(model) if model else geometry_from_config(config)
    except KeyError as e:
        raise ValueError(str(e.args[0])) from None
    clamp = env_clamp() if clamp is None else clamp
    return plan_regions(buffers(geometry, kv_dtype, page_size), tokens, clamp, transfer_backend, what=geometry.name)


__all__ = ["ALL_PRESETS", "CaptureError", "env_clamp", "registered", "regions", "replay", "synth", "unrun_backends"]
