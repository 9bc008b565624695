"""What to do after ``observed``: the captures and commands that tell its causes apart.

``observed`` (only the production output diverges; the offline paths agree on the captured inputs)
names four causes the capture alone cannot separate. Each :class:`NextStep` is one capture or
command, the causes it separates, and what its outcomes mean:

    another_step     the previous and next decode steps of the same layer and rank, replayed
                     together: the series check's kv_rows_changed (rows overwritten) and
                     stale_metadata (a graph or schedule that replayed the previous step's
                     metadata); a divergence at one step only is state at kernel time
    repeat           the production kernel on the production machine, N runs bit for bit
                     (``--repeat``): a kernel build that computes this input wrongly, or races
    disagg           the prefill side with ``refmla disagg``: are the captured KV rows the rows
                     the prefill wrote (transfer, overwrite) or did the kernel read them early
    graphs_off       a capture with CUDA / HIP graphs off: graph replay in or out
    writer           the KV writer's capture beside the decode's: was each row written where the
                     kernel reads it before it ran

Built by :func:`after_observed` from the diagnosis's causes and the capture's meta; the report
carries them (``ReplayReport.next_steps``, JSON ``next_steps``, docs/contract.md section 3).
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from typing import Any

# the causes an ``observed`` sentence names (refmla.diagnosis.OBSERVED_CAUSES), by key
CAUSES = {
    "kv_state": "KV not yet transferred or overwritten",
    "graph_replay": "CUDA/HIP graph replay",
    "capture_metadata": "metadata at capture time",
    "kernel_build": "a different kernel build",
}


@dataclass(frozen=True)
class NextStep:
    """One capture or command that tells some of a diagnosis's causes apart."""

    name: str  # "another_step" | "repeat" | "disagg" | "graphs_off" | "writer"
    run: str  # what to capture or run, as a person types it
    tells: str  # what its outcomes mean
    causes: tuple[str, ...]  # keys of CAUSES it separates

    def text(self) -> str:
        return f"{self.run} -- {self.tells}"

    def to_json(self) -> dict:
        return {"step": self.name, "run": self.run, "tells": self.tells, "causes": list(self.causes)}


def after_observed(causes: tuple[str, ...], capture: str, meta: Any, kernels_ok: list[str]) -> list[NextStep]:
    """The next steps for an ``observed`` diagnosis whose sentence names ``causes`` (none: []).

    capture: the capture's path; meta: its CaptureMeta (layer_id, tp_rank, step, backend, extra);
    kernels_ok: the offline kernels that agreed here."""
    if not causes:
        return []
    layer, rank, step = (getattr(meta, k, None) for k in ("layer_id", "tp_rank", "step"))
    extra = getattr(meta, "extra", None) or {}
    where = f"layer {layer} rank {rank}" if layer is not None and rank is not None else "its layer and rank"
    at = ("the neighbouring steps" if not isinstance(step, int) else f"step {step + 1}" if step == 0
          else f"steps {step - 1} and {step + 1}")  # fmt: skip
    filters = f"--layers {layer} --ranks {rank} " if layer is not None and rank is not None else ""
    steps = [NextStep(
        "another_step",
        f"capture {at} of {where} too (refmla capture run {filters}--every 1 ...) and replay them with this one: "
        f"refmla replay DIR",
        "the series check names rows overwritten between steps (kv_rows_changed) and an output computed under the "
        "previous step's metadata (stale_metadata: graph replay or capture-time metadata); a divergence at this step "
        "alone, the next agreeing over the same rows, is state at kernel time; one that persists is the kernel build",
        ("kv_state", "graph_replay", "capture_metadata", "kernel_build"))]
    produced = getattr(meta, "backend", None)
    kernel = produced if produced in kernels_ok or not kernels_ok else kernels_ok[0]
    version = ", ".join(f"{k} {extra[k]}" for k in ("sglang_version", "aiter_version", "engine_version") if extra.get(k))
    steps.append(NextStep(
        "repeat",
        f"on the production machine: refmla replay {shlex.quote(str(capture))} --backend {kernel} --repeat 20"
        + (f" (production ran {version}; refmla doctor shows what runs there)" if version else ""),
        "the production build diverging on the captured inputs, or runs that differ bit for bit, is the kernel "
        "(another build, or a race); 20 identical runs that agree rule the kernel build out",
        ("kernel_build",)))
    mode = extra.get("disagg_mode")
    if mode in (None, "decode"):
        steps.append(NextStep(
            "disagg",
            ("" if mode == "decode" else "if this is a disaggregated decode: ")
            + "capture the prefill node too (refmla capture run --modes extend --backends triton,aiter,kvwrite ...) "
            "and run refmla disagg PREFILL_DIR DECODE_DIR",
            "a transfer mismatch means the KV the decode holds is not the prompt's (the transfer or an overwrite); "
            "faithful rows mean the KV was right by capture time, so the kernel read it before it landed",
            ("kv_state",)))
    steps.append(NextStep(
        "graphs_off",
        "if the server ran with CUDA/HIP graphs, capture again with them off (SGLang --disable-cuda-graph, vLLM "
        "--enforce-eager)",
        "a divergence that persists with graphs off rules graph replay out; one that disappears points at it",
        ("graph_replay",)))
    steps.append(NextStep(
        "writer",
        "capture the KV writer beside the decode (add kvwrite to --backends) and replay both",
        "a writer capture that diverges (kv_writer) stored other rows or slots than the kernel reads: the rows were "
        "wrong when written, not when read",
        ("kv_state", "capture_metadata")))
    return steps


def text_lines(steps: list[NextStep]) -> list[str]:
    """The report's lines: a header, then one line per step."""
    if not steps:
        return []
    return ["next     to tell these causes apart:"] + [f"  {s.name}: {s.text()}" for s in steps]

