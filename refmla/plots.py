"""Pictures of a replay and of a diff-kv (``--plot DIR``). Needs matplotlib (``pip install 'refmla[plot]'``).

    plot_replay    per capture: <stem>.heatmap.png   error per (request, head) of the production
                   output and of every failing backend (abs error, and error / allowed: above 1
                   fails); <stem>.attention.png   the fp64 reference's attention weights over the
                   positions of the worst row, with the split boundaries, the pages, zero / NaN
                   rows and the range the explaining hypothesis names marked
    plot_diff_kv   one lane per request: positions compared, mismatched ranges, the transfer runs
                   holding mismatches

Figures are drawn with matplotlib's object API on the Agg canvas: no pyplot, no display, no
global state, safe in worker processes.
"""

from __future__ import annotations

import io

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

try:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.colors import LogNorm, TwoSlopeNorm
    from matplotlib.figure import Figure
except ImportError as e:  # the CLI turns this into one line and exit 2
    raise ImportError(f"refmla plots need matplotlib, which is not importable here ({e}); "
                      "install it with: pip install 'refmla[plot]'") from e  # fmt: skip

import torch

from refmla import reference as ref
from refmla.atomic import MARKER, make_dir, write_bytes
from refmla.backends import get_backend
from refmla.capture import CaptureError, read_capture
from refmla.compare import Tolerance
from refmla.context import ReplayContext, ReplayOptions
from refmla.diffkv.result import DiffResult
from refmla.pool import row_flags
from refmla.results import Explanation, ReplayReport
from refmla.schedule import split_bounds
from refmla.util import error_text

MAX_PAGE_SHADES = 400  # shade alternate pages only when there are at most this many


def _save(fig: Figure, path: Path) -> Path:
    """The PNG rendered in memory, then written atomically (refmla.atomic)."""
    FigureCanvasAgg(fig)
    buf = io.BytesIO()
    fig.savefig(buf, dpi=110, format="png", metadata={"Software": MARKER})  # refmla.atomic: ours to replace
    return write_bytes(path, buf.getbuffer(), make_parents=True)


def _stems(paths: list[str]) -> list[str]:
    """File stems, made unique when two captures share one."""
    seen: dict[str, int] = {}
    out = []
    for p in paths:
        s = Path(p).name.removesuffix(".safetensors")
        seen[s] = seen.get(s, 0) + 1
        out.append(s if seen[s] == 1 else f"{s}.{seen[s]}")
    return out


# --------------------------------------------------------------------------------------------
# Replay
# --------------------------------------------------------------------------------------------


def plot_replay(reports: list[ReplayReport], out_dir: Any, failures: Optional[list[str]] = None) -> list[Path]:
    """Write the heat map and the worst row's attention plot for every replayed capture.

    Re-reads each capture from ``report.capture``; the error matrices are recomputed for the
    production output and re-run for backends whose status is ``fail``. Invalid captures are skipped.
    With ``failures`` given, a capture whose plots fail gets one line there ("PATH: why") and the
    others are still drawn.
    """
    out_dir = Path(out_dir)
    make_dir(out_dir)
    written: list[Path] = []
    for report, stem in zip(reports, _stems([r.capture for r in reports])):
        if not report.backends:
            continue
        try:
            written += _plot_one(report, out_dir, stem)
        except Exception as e:
            if failures is None:
                raise
            failures.append(f"{report.capture}: plot: {error_text(e)}")
    return written


def _plot_one(report: ReplayReport, out_dir: Path, stem: str) -> list[Path]:
    """The heat map and the attention plot of one replayed capture."""
    written: list[Path] = []
    try:
        cap = read_capture(report.capture)
    except CaptureError:
        return written
    errors = _error_matrices(cap, report)
    if errors:
        written.append(_save(_heatmap_figure(cap, report, errors), out_dir / f"{stem}.heatmap.png"))
    row = _worst_row(report)
    if row is not None and cap.batch_size:
        written.append(_save(_attention_figure(cap, report, *row), out_dir / f"{stem}.attention.png"))
    return written


def _error_matrices(cap, report: ReplayReport) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """backend -> (abs error [R, H], allowed [R, H], a NaN / Inf misplaced [R, H]) for observed and
    every failing backend."""
    names = [n for n, b in report.backends.items() if n == "observed" and b.ran or b.status == "fail"]
    if not names:
        return {}
    ctx = ReplayContext(cap, ReplayOptions(tol=report.tolerance or Tolerance(), explain=False))
    out = {}
    for name in dict.fromkeys(names):
        try:
            res = get_backend(name).run(cap, ctx.opts)
        except Exception:  # it failed or vanished since the replay: nothing to draw
            continue
        cmp = ctx.compare(name, res.out)
        if cmp.row_err is not None:
            out[name] = (cmp.row_err, cmp.row_tol, cmp.row_nonfinite)
    return out


@dataclass
class HeatValues:
    """One backend's heat map values: a row with a misplaced NaN / Inf is drawn as the worst of
    both panels (its finite elements' error says nothing of it) and counted as failing."""

    err: Any  # [R, H] numpy, abs error; non-finite rows at the top of the scale
    ratio: Any  # [R, H] numpy, error / allowed; non-finite rows at the top of the scale
    vmin: float
    vmax: float
    hi: float  # the ratio panel's top
    failing: int  # rows over their allowance or non-finite
    nonfinite: int

    def title(self, name: str) -> str:
        extra = f" ({self.nonfinite} non-finite)" if self.nonfinite else ""
        return f"{name}: error / allowed, {self.failing} of {self.ratio.size} rows fail{extra}"


def heat_values(err: torch.Tensor, allowed: torch.Tensor, nonfinite: Optional[torch.Tensor] = None) -> HeatValues:
    err = err.double()
    nonfinite = torch.zeros_like(err, dtype=torch.bool) if nonfinite is None else nonfinite.bool()
    ratio = err / allowed.double().clamp(min=1e-300)
    pos = err[(err > 0) & ~nonfinite]
    vmin = float(pos.min()) if pos.numel() else 1e-12
    vmax = max(float(err.max()) if err.numel() else vmin, vmin * 10)
    hi = max(float(ratio.max()) if ratio.numel() else 0.0, 2.0)
    err = torch.where(nonfinite, vmax, err.clamp(min=vmin))
    ratio = torch.where(nonfinite, hi, ratio)
    failing = int(((ratio > 1) | nonfinite).sum())
    return HeatValues(err.numpy(), ratio.numpy(), vmin, vmax, hi, failing, int(nonfinite.sum()))


def _heatmap_figure(cap, report: ReplayReport, errors: dict) -> Figure:
    R = next(iter(errors.values()))[0].shape[0]
    fig = Figure(figsize=(12, 1.8 + min(0.22 * R, 9) * len(errors)), layout="constrained")
    axes = fig.subplots(len(errors), 2, squeeze=False)
    bounds = [] if cap.is_decode else cap.attended().query_indptr.tolist()[1:-1]
    ylabel = "request" if cap.is_decode else "row (token); lines: requests"
    for (name, (err, allowed, nonfinite)), (ax_e, ax_r) in zip(errors.items(), axes):
        v = heat_values(err, allowed, nonfinite)
        im = ax_e.imshow(v.err, aspect="auto", interpolation="nearest", cmap="viridis",
                         norm=LogNorm(vmin=v.vmin, vmax=v.vmax))  # fmt: skip
        fig.colorbar(im, ax=ax_e, label="max abs error (NaN / Inf: the top)")
        ax_e.set_title(f"{name}: max abs error per (row, head)")
        im = ax_r.imshow(v.ratio, aspect="auto", interpolation="nearest", cmap="RdBu_r",
                         norm=TwoSlopeNorm(vcenter=1.0, vmin=0.0, vmax=v.hi))  # fmt: skip
        fig.colorbar(im, ax=ax_r, label="error / allowed (> 1 fails)")
        ax_r.set_title(v.title(name))
        for ax in (ax_e, ax_r):
            ax.set_xlabel("head")
            ax.set_ylabel(ylabel)
            for y in bounds:
                ax.axhline(y - 0.5, color="k", lw=0.6)
    fig.suptitle(f"{Path(cap.path).name}: {report.verdict}" + (f" ({report.diagnosis})" if report.diagnosis else ""))
    return fig


def _worst_row(report: ReplayReport) -> Optional[tuple[int, int, str, Optional[Explanation]]]:
    """(row, head, backend, explanation) of the first failing backend (one with an explanation
    first), else of the production output; None when nothing was compared."""
    cands = [(n, b) for n, b in report.backends.items() if b.status == "fail"]
    cands.sort(key=lambda nb: nb[1].explanation is None)
    cands += [(n, b) for n, b in report.backends.items() if n == "observed" and b.status == "pass"]
    for name, b in cands:
        w = b.worst
        if w is None or w.head is None or w.request is None:
            continue
        return int(w.row if "row" in w.keys else w.request), int(w.head), name, b.explanation
    return None


PLOT_BLOCK_ROWS = 16384  # rows upcast at once for the attention figure's logits


def _attention_figure(cap, report: ReplayReport, row: int, head: int, backend: str,
                      expl: Optional[Explanation]) -> Figure:  # fmt: skip
    att = cap.attended()
    b = int(att.group_of_row[row])
    L = int(att.lengths()[b])
    seen = att.rows_seen(row)  # [L_seen] the rows this query row attends, position order
    L_seen = seen.numel()
    m = cap.meta
    qd = cap.q[row, head].double()  # [D]
    s = torch.cat([ref.gather(cap.kv_buffer, seen[i : i + PLOT_BLOCK_ROWS], torch.float64) @ qd  # a block at a time
                   for i in range(0, L_seen, PLOT_BLOCK_ROWS)] or [qd.new_zeros(0)]) * (m.sm_scale * m.k_scale)  # [L_seen]
    if m.logit_cap > 0:
        s = m.logit_cap * torch.tanh(s / m.logit_cap)
    p = torch.softmax(s, dim=0).numpy() if L_seen else s.numpy()  # [L_seen]

    fig = Figure(figsize=(13, 4.8), layout="constrained")
    ax = fig.subplots()
    x = range(L_seen)
    ax.plot(x, [max(v, 1e-30) if math.isfinite(v) else float("nan") for v in p], lw=0.8, color="C0",
            label="reference attention weight")  # fmt: skip
    ax.set_yscale("log")
    ax.set_xlabel("position")
    ax.set_ylabel("softmax weight (fp64 reference)")
    top = max(L_seen, 1)

    P = m.page_size
    npages = -(-top // P)
    if P > 1 and npages <= MAX_PAGE_SHADES:
        for pg in range(1, npages, 2):
            ax.axvspan(pg * P - 0.5, min((pg + 1) * P, top) - 0.5, color="0.92", lw=0, zorder=0)
        ax.plot([], [], color="0.85", lw=6, label=f"pages of {P} (alternate shading)")
    if cap.is_decode and cap.num_kv_splits is not None:
        bounds = split_bounds(L, int(cap.num_kv_splits[b]))
        starts = [a for a, e in bounds if e > a][1:]
        for a in starts:
            ax.axvline(a - 0.5, color="C2", ls="--", lw=0.9)
        if starts:
            ax.plot([], [], color="C2", ls="--", label=f"split boundaries ({int(cap.num_kv_splits[b])} splits)")
    if expl:
        _mark_explanation(ax, expl, b, L, cap)
    if L_seen:
        flags = row_flags(cap.kv_buffer, seen, m.kv_lora_rank)
        for key, color, text in (("zero", "k", "all-zero KV row"), ("nonfinite", "m", "NaN/Inf KV row")):
            js = torch.nonzero(flags[key]).flatten().tolist()
            if js:
                ax.plot(js, [1e-29] * len(js), "|", color=color, ms=14, label=f"{text} ({len(js)})")
    ax.set_xlim(-0.5, max(top, ax.get_xlim()[1]) - 0.5 if L_seen else 1)
    fig.legend(loc="outside lower center", ncols=3, fontsize=8)
    ax.set_title(f"{Path(cap.path).name}: worst row of {backend}, {cap.label(b)}"
                 + ("" if cap.is_decode else f" token {row}") + f", head {head}, seq_len {L}")  # fmt: skip
    return fig


def _mark_explanation(ax, expl: Explanation, b: int, L: int, cap) -> None:
    name, d = expl.hypothesis, expl.detail or {}
    if expl.request is not None and expl.request != b:
        return
    span = None
    if name == "kv_range_missing" and "start" in d and "end" in d:
        span = (d["start"], d["end"])
    elif name == "seq_len_off_by" and d.get("delta"):
        k = int(d["delta"])
        span = (L + k, L) if k < 0 else (L, L + k)
    elif name == "split_missing" and "split" in d and cap.num_kv_splits is not None:
        bounds = split_bounds(L, int(cap.num_kv_splits[b]))
        if int(d["split"]) < len(bounds):
            span = bounds[int(d["split"])]
    label = f"explained: {name}(" + ", ".join(f"{k}={v}" for k, v in d.items() if not isinstance(v, list)) + ")"
    if span is not None:
        ax.axvspan(span[0] - 0.5, span[1] - 0.5, color="C3", alpha=0.25, lw=0, label=label)
        if span[1] > L:
            ax.set_xlim(-0.5, span[1] + 0.5)
    else:
        ax.text(0.01, 0.02, label, transform=ax.transAxes, fontsize=9, color="C3")


# --------------------------------------------------------------------------------------------
# diff-kv
# --------------------------------------------------------------------------------------------


def plot_diff_kv(result: DiffResult, out_dir: Any) -> list[Path]:
    """One lane per request: compared positions (grey), mismatched ranges (red), transfer runs
    holding mismatches (outlined). Requests with mismatches come first; at most 96 lanes."""
    out_dir = Path(out_dir)
    make_dir(out_dir)
    reqs = [e for e in result.requests if e.positions_compared]
    reqs.sort(key=lambda e: e.mismatched_positions == 0)
    reqs = reqs[:96]
    fig = Figure(figsize=(13, 1.5 + 0.32 * max(len(reqs), 1)), layout="constrained")
    ax = fig.subplots()
    for lane, e in enumerate(reqs):
        y = len(reqs) - 1 - lane
        ax.broken_barh([(0, e.positions_compared)], (y - 0.3, 0.6), color="0.85")
        rng = [(a, b - a) for a, b in e.mismatches.ranges] if e.mismatches is not None else []
        if rng:
            ax.broken_barh(rng, (y - 0.3, 0.6), color="C3")
        for run in e.transfer_runs.mismatched if e.transfer_runs is not None else []:
            ax.broken_barh([(run.start, run.positions)], (y - 0.42, 0.84), facecolor="none",
                           edgecolor="k", lw=0.8)  # fmt: skip
    ax.set_yticks(range(len(reqs)), [str(e.request) for e in reversed(reqs)], fontsize=7)
    ax.set_xlabel(f"position (pages of {result.page_size})")
    ax.plot([], [], color="0.85", lw=6, label="compared, identical")
    ax.plot([], [], color="C3", lw=6, label="mismatched")
    if any(e.transfer_runs is not None for e in reqs):
        ax.plot([], [], color="k", lw=0.8, label="transfer run (contiguous on both sides) holding mismatches")
    P, top = result.page_size or 1, max((e.positions_compared for e in reqs), default=0)
    if P > 1 and 0 < top // P <= MAX_PAGE_SHADES:
        ax.set_xticks([k * P for k in range(top // P + 1)], minor=True)
        ax.grid(True, axis="x", which="minor", color="0.75", lw=0.4)
    fig.legend(loc="outside lower center", ncols=3, fontsize=8)
    verdict = (
        "identical"
        if result.ok
        else (f"{result.mismatched_positions} of {result.positions_compared} positions mismatched")
    )
    ax.set_title(f"diff-kv {Path(result.decode).name}: {verdict}")
    name = Path(result.decode).name.removesuffix(".safetensors")
    return [_save(fig, out_dir / f"diffkv.{name}.png")]
