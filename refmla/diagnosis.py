"""Which compute path diverges: one machine name per class, and a sentence for people.

    null                  every backend agrees with the reference
    observed              only the production output diverges; the offline paths agree on the
                          captured inputs (state, KV transfer, graph replay, capture-time metadata)
    observed_unconfirmed  the production output diverges and no offline path ran to tell why
    decode                a decode kernel (triton, aiter) diverges while the extend baseline agrees
    extend                the extend baseline diverges while the decode kernels agree
    shared_input          decode and extend both diverge (the inputs they share, the meta, or the
                          reference's assumptions)
    numerics              every failing backend is explained by a numerics variant: the kernel
                          computes the same attention with different rounding (named); no data
                          or metadata fault
    backend_error         a backend crashed and nothing diverged
    metadata              the capture's metadata is invalid; nothing was replayed

"Decode diverges" counts the offline decode kernels; when none ran, the observed production
output stands for the decode path (it is what the production decode kernel wrote).
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

DECODE_KERNELS = ("triton", "aiter")
EXTEND = "extend"

SENTENCES = {
    None: "all backends agree with the reference",
    "metadata": "the capture's metadata is invalid; nothing was replayed",
    "observed": (
        "only the production output diverges: {agree} with the reference on the captured inputs, "
        "so what the production kernel read differed from the capture (KV not yet transferred or "
        "overwritten, CUDA/HIP graph replay, metadata at capture time) or it ran a different kernel build"
    ),
    "observed_unconfirmed": (
        "the production output diverges and no offline path ran here to tell a state problem from "
        "a kernel problem; replay on a machine with the kernels"
    ),
    "decode": (
        "the decode compute path diverges ({bad}) while the extend baseline agrees on the same "
        "captured state: the decode kernel computes this input wrongly"
    ),
    "decode_alone": (
        "the decode compute path diverges ({bad}); the extend baseline did not run, so a problem in "
        "the shared inputs is not excluded"
    ),
    "extend": "the extend baseline diverges while {agree}: suspect the extend path or its inputs",
    "shared_input": (
        "decode ({bad}) and extend both diverge: suspect something they share (the captured inputs, "
        "sm_scale or other meta) or the reference's assumptions"
    ),
    "backend_error": "a backend raised an error ({bad}); see its reason",
    "numerics": (
        "the kernel computes the same attention with different rounding ({variants}); no data or "
        "metadata fault ({bad} outside the tolerance only through rounding)"
    ),
}
NUMERICS = "numerics"  # the hypothesis family whose explanations make the diagnosis ``numerics``


def diagnose(
    statuses: dict[str, str], invalid: bool = False, produced_by: Optional[str] = None,
    explained: Optional[Mapping[str, tuple[str, Mapping[str, Any]]]] = None,
) -> tuple[Optional[str], str, list[str]]:  # fmt: skip
    """(machine name, sentence, backends it is about) from each backend's status.

    statuses: backend name -> "pass" | "fail" | "skipped" | "error". produced_by: the capture's
    meta backend (optional), to say whether the production kernel itself was replayed.
    explained (optional): failing backend -> (hypothesis, detail) of its explanation; when every
    failing backend is explained by ``numerics``, the class is ``numerics``.
    """
    if invalid:
        return "metadata", SENTENCES["metadata"], []
    failed = [n for n, s in statuses.items() if s == "fail"]
    numeric = numeric_variants(failed, explained or {})
    if numeric:
        return (*_say("numerics", variants=", ".join(numeric), bad=", ".join(failed)), failed)
    ran = {n for n, s in statuses.items() if s in ("pass", "fail")}
    decode_ran = [n for n in DECODE_KERNELS if n in ran]
    decode_bad = [n for n in decode_ran if n in failed]
    decode_ok = [n for n in decode_ran if n not in failed]
    extend = statuses.get(EXTEND)
    observed_bad = "observed" in failed
    # with no decode kernel replayed, the production output is the decode path's only witness
    decode_side = decode_bad or (["observed"] if observed_bad and not decode_ran else [])

    if decode_side and extend == "fail":
        return (*_say("shared_input", bad=", ".join(decode_side)), [*decode_side, EXTEND])
    if decode_bad:
        about = decode_bad + (["observed"] if observed_bad else [])
        if extend == "pass":
            return (*_say("decode", bad=", ".join(decode_bad)), about)
        return "decode", SENTENCES["decode_alone"].format(bad=", ".join(decode_bad)), about
    if extend == "fail":
        if decode_ok:
            agree = f"the decode {'kernels' if len(decode_ok) > 1 else 'kernel'} ({', '.join(decode_ok)}) agree"
        elif statuses.get("observed") == "pass":
            agree = "the production decode output agrees"
        else:
            agree = "no decode path ran to compare"
        return (*_say("extend", agree=agree), [EXTEND])
    if observed_bad:
        agree = decode_ok + ([EXTEND] if extend == "pass" else [])
        if not agree:
            return (*_say("observed_unconfirmed"), ["observed"])
        what = " and ".join(agree)
        what = f"the offline paths ({what}) agree" if len(agree) > 1 else f"the offline path ({what}) agrees"
        name, sentence = _say("observed", agree=what)
        if produced_by in DECODE_KERNELS and produced_by not in decode_ok:
            sentence += f"; the production kernel ({produced_by}) itself could not be replayed here"
        elif not decode_ok:
            sentence += "; no decode kernel ran here, so a decode kernel bug is not excluded"
        return name, sentence, ["observed"]
    errored = [n for n, s in statuses.items() if s == "error"]
    if errored:
        return (*_say("backend_error", bad=", ".join(errored)), errored)
    return None, SENTENCES[None], []


def numeric_variants(failed: list[str], explained: Mapping[str, tuple[str, Mapping[str, Any]]]) -> list[str]:
    """The variants (in order, once each) when every failing backend's explanation is numeric, else []."""
    if not failed or any(explained.get(n, ("", {}))[0] != NUMERICS for n in failed):
        return []
    return list(dict.fromkeys(str(explained[n][1].get("variant")) for n in failed))


def _say(name: Optional[str], **fields: str) -> tuple[Optional[str], str]:
    return name, SENTENCES[name].format(**fields)
