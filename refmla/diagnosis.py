"""Which compute path diverges: one machine name per class, and a sentence for people."""

from __future__ import annotations

from typing import Optional

DECODE_KERNELS = ("triton", "aiter")

SENTENCES = {
    None: "all backends agree with the reference",
    "metadata": "the capture's metadata is invalid; nothing was replayed",
    "observed": (
        "only the production output diverges: the offline kernels agree with the reference on the "
        "captured inputs, so what the production kernel read differed from the capture (KV not yet "
        "transferred or overwritten, CUDA/HIP graph replay, metadata at capture time) or it ran a "
        "different kernel build"
    ),
    "observed_unconfirmed": (
        "the production output diverges and no offline kernel ran here to tell a state problem from "
        "a kernel problem; replay on a machine with the kernels"
    ),
    "decode": (
        "the decode compute path diverges while the extend baseline agrees: the decode kernel "
        "computes this input wrongly"
    ),
    "extend": "the extend baseline diverges while the decode kernels agree",
    "shared_input": (
        "decode and extend both diverge: suspect something they share (the captured inputs, sm_scale "
        "or other meta) or the reference's assumptions"
    ),
    "backend_error": "a backend raised an error; see its reason",
}


def diagnose(statuses: dict[str, str], invalid: bool = False) -> tuple[Optional[str], str, list[str]]:
    """(machine name, sentence, backends it is about) from each backend's status."""
    if invalid:
        return "metadata", SENTENCES["metadata"], []
    failed = [n for n, s in statuses.items() if s == "fail"]
    decode_bad = [n for n in failed if n in DECODE_KERNELS]
    offline_ran = [n for n, s in statuses.items() if s in ("pass", "fail") and n not in ("reference", "observed")]
    if decode_bad and "extend" in failed:
        name = "shared_input"
    elif decode_bad:
        name = "decode"
    elif "extend" in failed:
        name = "extend"
    elif "observed" in failed:
        name = "observed" if offline_ran else "observed_unconfirmed"
    elif any(s == "error" for s in statuses.values()):
        name = "backend_error"
        failed = [n for n, s in statuses.items() if s == "error"]
    else:
        name = None
    return name, SENTENCES[name], failed
