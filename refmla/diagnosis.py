"""Which compute path diverges: one machine name per class, and a sentence for people.

    null                  every backend agrees with the reference
    observed              only the production output diverges; the offline paths agree on the
                          captured inputs (state, KV transfer, graph replay, capture-time metadata);
                          when the capture names an aiter path (persistent, gluon, ...) that was
                          not replayed, the sentence names that kernel instead of the state
    observed_unconfirmed  the production output diverges and no offline path ran to tell why
    decode                a decode kernel (triton, aiter, flex) diverges while the extend baseline agrees
    extend                the extend baseline diverges while the decode kernels agree
    shared_input          decode and extend both diverge (the inputs they share, the meta, or the
                          reference's assumptions)
    numerics              every failing backend is explained by a numerics variant: the kernel
                          computes the same attention with different rounding (named); no data
                          or metadata fault
    backend_error         a backend crashed and nothing diverged
    upstream_nonfinite    a request's q or attended KV rows hold NaN / Inf: the input is already
                          non-finite, the fault is upstream of attention (whatever the kernels wrote)
    metadata              the capture's metadata is invalid; nothing was replayed
    verify                (verify captures) a verify path (aiter max_seqlen_q > 1, the Triton extend
                          with the mask) diverges while the plain decode over the same KV agrees

Verify captures (:func:`diagnose_verify`) ask the seed's question -- over the same KV, does the
verify path or the plain-decode path diverge? -- and answer it with ``verify``, ``decode`` (the
plain decode per query diverges while verify agrees), ``shared_input`` (both), or the classes above.

"Decode diverges" counts the offline decode kernels; when none ran, the observed production
output stands for the decode path (it is what the production decode kernel wrote).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from refmla.util import request_label

DECODE_KERNELS = ("triton", "aiter", "flex", "vllm_triton", "flashmla", "flashinfer_mla", "cutlass_mla", "fa3_mla")  # offline decode paths (flex: an independent compiled kernel)
EXTEND = "extend"

SENTENCES = {
    None: "all backends agree with the reference",
    "metadata": "the capture's metadata is invalid; nothing was replayed",
    "upstream_nonfinite": "the input is already non-finite: the fault is upstream of attention ({where})",
    "observed": (
        "only the production output diverges: {agree} with the reference on the captured inputs, "
        "so what the production kernel read differed from the capture (KV not yet transferred or "
        "overwritten, CUDA/HIP graph replay, metadata at capture time) or it ran a different kernel build"
    ),
    "observed_masking": (
        "only the production output diverges, and a masking mistake explains it ({hypothesis}): the "
        "production kernel{kernel} applied the verify mask wrongly while {agree} with the reference on the "
        "same captured inputs; the mask is the kernel's, not a state or transfer problem"
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
    "verify": (
        "the verify path diverges ({bad}) while the plain decode over the same KV agrees ({agree}): "
        "the multi-token verify kernel computes this input wrongly"
    ),
    "verify_alone": "the verify path diverges ({bad}); no plain-decode path ran over the same KV to compare",
    "verify_production_alone": (
        "the production verify output diverges (observed) and no offline path ran over the same KV, neither a "
        "verify kernel nor the plain decode, so it stands for the verify path; replayed with them (the default "
        "backends), the class says which diverges: observed when an offline path agrees (production's own call), "
        "verify or decode when one of them diverges too"
    ),
    "verify_observed": (
        "the production verify output diverges while the plain decode over the same captured KV agrees ({agree}); "
        "no offline verify kernel ran here, so the verify kernel and the state at kernel time (KV not yet "
        "written, graph replay) are both suspects: replay where aiter / the Triton extend runs"
    ),
    "verify_decode": (
        "the plain-decode path diverges over the same KV ({bad}) while the verify path agrees ({agree}): "
        "the decode kernel computes this KV wrongly (verify fine, plain decode not)"
    ),
    "verify_shared": (
        "verify ({verify}) and plain decode ({decode}) both diverge over the same KV: suspect the KV or the "
        "inputs they share (transfer, meta), not one kernel"
    ),
    "kv_contract": (
        "{hypothesis}: {bad} read the KV bytes another way than they were written ({detail}); the contract "
        "between the KV writer and the reader is broken, not the attention math"
    ),
    "numerics": (
        "the kernel computes the same attention with different rounding ({variants}); no data or "
        "metadata fault ({bad} outside the tolerance only through rounding)"
    ),
}


@dataclass(frozen=True)
class Diagnosis:
    """Which compute path diverges: the class's machine name (None: all agree), the sentence for
    people, and the backends it is about."""

    name: Optional[str]
    text: str
    backends: list[str] = field(default_factory=list)
    # the causes the sentence names and leaves open (refmla.nextsteps.CAUSES keys): what the report's
    # next steps tell apart; empty where the sentence names the one cause
    causes: tuple = ()


# the causes the ``observed`` sentence names, in its order (refmla.nextsteps.CAUSES keys)
OBSERVED_CAUSES = ("kv_state", "graph_replay", "capture_metadata", "kernel_build")
NUMERICS = "numerics"  # the hypothesis family whose explanations make the diagnosis ``numerics``
# the families whose explanations make the diagnosis ``kv_contract``: the bytes read another way (added)
BYTES_CONTRACT = ("kv_fp8_encoding_mismatch", "kv_scale_format", "kv_page_stride")
MASKING = ("causal_alignment", "mask_wrong_request", "qlen_pow2_padding")  # the verify mask's families

# verify captures: which backend stands for which path over the same KV
VERIFY_PATHS = {"extend": "verify", "aiter": "verify", "triton_decode_per_query": "plain decode",
                "aiter_decode_per_query": "plain decode"}  # fmt: skip


UNREPLAYED = (
    "only the production output diverges, and production ran aiter's {path} kernel, not replayed here: "
    "{reason}. The offline paths that ran ({agree}) are other kernels, so this is not evidence of a "
    "state or transfer problem: replay that path (docs/aiter.md) before suspecting the state"
)


def unreplayed_path(recorded: Optional[str], status: Optional[str], info: Optional[dict],
                    reason: Optional[str]) -> Optional[str]:  # fmt: skip
    """Why the aiter path production ran was not replayed, or None when it was (or none is recorded).

    recorded: the capture's meta ``aiter_path``; status / info / reason: the aiter backend's entry
    (status None when the aiter backend was not run).
    """
    if not recorded:
        return None
    if status is None:
        return "the aiter backend was not run (add --backend aiter)"
    if status in ("skipped", "error"):
        return reason or status
    ran = (info or {}).get("path")
    if ran != recorded:
        return f"the aiter backend replayed the {ran or 'unknown'} path instead"
    return None


def diagnose(
    statuses: dict[str, str], invalid: bool = False, produced_by: Optional[str] = None,
    explained: Optional[Mapping[str, tuple[str, Mapping[str, Any]]]] = None,
    unreplayed: Optional[tuple[str, str]] = None,
) -> Diagnosis:  # fmt: skip
    """The :class:`Diagnosis` (machine name, sentence, backends it is about) from each backend's status.

    statuses: backend name -> "pass" | "fail" | "skipped" | "error". produced_by: the capture's
    meta backend (optional), to say whether the production kernel itself was replayed.
    explained (optional): failing backend -> (hypothesis, detail) of its explanation; when every
    failing backend is explained by ``numerics``, the class is ``numerics``.
    unreplayed: (aiter path production ran, why it was not replayed) from :func:`unreplayed_path`;
    an ``observed`` divergence then names that kernel instead of suggesting state or transfer.
    """
    if invalid:
        return Diagnosis("metadata", SENTENCES["metadata"])
    failed = [n for n, s in statuses.items() if s == "fail"]
    numeric = numeric_variants(failed, explained or {})
    if numeric:
        return _say("numerics", failed, variants=", ".join(numeric), bad=", ".join(failed))
    contract = [(explained or {}).get(n) for n in failed]
    if failed and all(c is not None and c[0] in BYTES_CONTRACT for c in contract):
        detail = ", ".join(f"{k}={v}" for k, v in contract[0][1].items())
        return _say("kv_contract", failed, hypothesis=contract[0][0], bad=", ".join(failed), detail=detail)
    ran = {n for n, s in statuses.items() if s in ("pass", "fail")}
    decode_ran = [n for n in statuses if n in ran and is_decode_kernel(n)]
    decode_bad = [n for n in decode_ran if n in failed]
    decode_ok = [n for n in decode_ran if n not in failed]
    extend = statuses.get(EXTEND)
    observed_bad = "observed" in failed
    # with no decode kernel replayed, the production output is the decode path's only witness
    decode_side = decode_bad or (["observed"] if observed_bad and not decode_ran else [])

    if decode_side and extend == "fail":
        return _say("shared_input", [*decode_side, EXTEND], bad=", ".join(decode_side))
    if decode_bad:
        about = decode_bad + (["observed"] if observed_bad else [])
        if extend == "pass":
            return _say("decode", about, bad=", ".join(decode_bad))
        return Diagnosis("decode", SENTENCES["decode_alone"].format(bad=", ".join(decode_bad)), about)
    if extend == "fail":
        if decode_ok:
            agree = f"the decode {'kernels' if len(decode_ok) > 1 else 'kernel'} ({', '.join(decode_ok)}) agree"
        elif statuses.get("observed") == "pass":
            agree = "the production decode output agrees"
        else:
            agree = "no decode path ran to compare"
        return _say("extend", [EXTEND], agree=agree)
    if observed_bad:
        masking = (explained or {}).get("observed")
        if masking is not None and masking[0] in MASKING and (decode_ok or extend == "pass"):
            return Diagnosis("observed", _masking_sentence(masking, decode_ok, extend == "pass", produced_by), ["observed"])
        name, sentence = _observed(decode_ok, extend == "pass", produced_by, unreplayed)
        state = name == "observed" and unreplayed is None  # the sentence that names the four causes
        return Diagnosis(name, sentence, ["observed"], OBSERVED_CAUSES if state else ())
    errored = [n for n, s in statuses.items() if s == "error"]
    if errored:
        return _say("backend_error", errored, bad=", ".join(errored))
    return Diagnosis(None, SENTENCES[None])


def is_decode_kernel(name: str) -> bool:
    """Every offline kernel that computes the decode output is a decode path: triton, aiter, flex and
    any backend added since (vllm_triton, flashmla, ...). Only the reference, the production output,
    the extend baseline and the verify captures' per-query plain decodes are not, so a failing kernel is never left unclassified
    (an unknown name once fell through to "all backends agree" on a diverged replay)."""
    return name not in ("reference", "observed", EXTEND) and VERIFY_PATHS.get(name) != "plain decode"


def diagnose_upstream(findings: list) -> Diagnosis:
    """``upstream_nonfinite`` from the metadata's ``nonfinite_input`` findings (refmla.checks): the
    requests, q's heads and the tensors named; it outranks every backend's status."""
    where = "; ".join(f"{request_label(f.request, f.rid)}: NaN/Inf in {f.numbers['where']}" for f in findings[:4])
    more = f"; {len(findings) - 4} more request(s)" if len(findings) > 4 else ""
    return Diagnosis("upstream_nonfinite", SENTENCES["upstream_nonfinite"].format(where=where + more))


def numeric_variants(failed: list[str], explained: Mapping[str, tuple[str, Mapping[str, Any]]]) -> list[str]:
    """The variants (in order, once each) when every failing backend's explanation is numeric, else []."""
    if not failed or any(explained.get(n, ("", {}))[0] != NUMERICS for n in failed):
        return []
    return list(dict.fromkeys(str(explained[n][1].get("variant")) for n in failed))


def _observed(
    decode_ok: list[str], extend_ok: bool, produced_by: Optional[str], unreplayed: Optional[tuple[str, str]]
) -> tuple[str, str]:
    """Only the production output diverges: (class, sentence), naming the offline paths that agree
    and, when production ran a kernel not replayed here, that kernel instead of state or transfer."""
    agree = decode_ok + ([EXTEND] if extend_ok else [])
    if not agree:
        sentence = SENTENCES["observed_unconfirmed"]
        if unreplayed is not None:
            sentence += f"; production ran aiter's {unreplayed[0]} kernel, not replayed here: {unreplayed[1]}"
        return "observed_unconfirmed", sentence
    what = " and ".join(agree)
    if unreplayed is not None:
        path, reason = unreplayed
        return "observed", UNREPLAYED.format(path=path, reason=reason.rstrip("."), agree=what)
    what = f"the offline paths ({what}) agree" if len(agree) > 1 else f"the offline path ({what}) agrees"
    sentence = SENTENCES["observed"].format(agree=what)
    if produced_by in DECODE_KERNELS and produced_by not in decode_ok:
        sentence += f"; the production kernel ({produced_by}) itself could not be replayed here"
    elif not decode_ok:
        sentence += "; no decode kernel ran here, so a decode kernel bug is not excluded"
    return "observed", sentence


def _masking_sentence(explanation: tuple[str, Mapping[str, Any]], decode_ok: list[str], extend_ok: bool,
                      produced_by: Optional[str]) -> str:
    """The ``observed`` sentence when a masking family explains the production output (never "KV not yet transferred")."""
    hyp, detail = explanation
    fields = ", ".join(f"{k}={v}" for k, v in detail.items() if isinstance(v, (str, int, float)))
    agree = decode_ok + ([EXTEND] if extend_ok else [])
    what = f"the offline paths ({' and '.join(agree)}) agree" if len(agree) > 1 else f"the offline path ({agree[0]}) agrees"
    return SENTENCES["observed_masking"].format(hypothesis=f"{hyp}({fields})", agree=what,
                                                kernel=f" ({produced_by})" if produced_by else "")  # fmt: skip


def _say(name: str, backends: list[str], **fields: str) -> Diagnosis:
    return Diagnosis(name, SENTENCES[name].format(**fields), backends)


def diagnose_verify(
    statuses: dict[str, str], produced_by: Optional[str] = None, **rest: Any
) -> Diagnosis:
    """:func:`diagnose` for a verify capture: verify paths against the plain decode over the same KV.
    ``rest`` (unreplayed, explained) goes to :func:`diagnose` when neither path diverges.

    The production output (``observed``) is the verify path's witness when no offline verify path ran.
    """
    ran = {n for n, s in statuses.items() if s in ("pass", "fail")}
    paths = {p: [n for n, q in VERIFY_PATHS.items() if q == p and n in ran] for p in ("verify", "plain decode")}
    bad = {p: [n for n in ns if statuses[n] == "fail"] for p, ns in paths.items()}
    ok = {p: [n for n in ns if statuses[n] == "pass"] for p, ns in paths.items()}
    if statuses.get("observed") == "fail" and not paths["verify"]:
        bad["verify"] = ["observed"]
    v, d = bad["verify"], bad["plain decode"]
    if v and d:
        sentence = SENTENCES["verify_shared"].format(verify=", ".join(v), decode=", ".join(d))
        return Diagnosis("shared_input", sentence, v + d)
    masking = (rest.get("explained") or {}).get("observed")
    if v == ["observed"] and ok["plain decode"] and masking is not None and masking[0] in MASKING:
        return Diagnosis("verify", _masking_sentence(masking, ok["plain decode"], False, produced_by), v)
    if v == ["observed"] and ok["plain decode"]:
        return Diagnosis("verify", SENTENCES["verify_observed"].format(agree=", ".join(ok["plain decode"])), v)
    if v:
        if ok["plain decode"]:
            sentence = SENTENCES["verify"].format(bad=", ".join(v), agree=", ".join(ok["plain decode"]))
            return Diagnosis("verify", sentence, v)
        if v == ["observed"] and not paths["verify"] and not paths["plain decode"]:
            return Diagnosis("verify", SENTENCES["verify_production_alone"], v)
        return Diagnosis("verify", SENTENCES["verify_alone"].format(bad=", ".join(v)), v)
    if d:
        agree = ", ".join(ok["verify"]) or ("the production output" if statuses.get("observed") == "pass" else "none ran")
        return Diagnosis("decode", SENTENCES["verify_decode"].format(bad=", ".join(d), agree=agree), d)
    return diagnose(statuses, produced_by=produced_by, **rest)


def verify_table(entries: dict) -> list[dict]:
    """One row per path over the same KV: path, backend, status, max_abs_err, reason (skipped / failed)."""
    rows = []
    for name, path in [("observed", "verify (production)"), *VERIFY_PATHS.items()]:
        e = entries.get(name)
        if e is not None:
            rows.append({"path": path, "backend": name, "status": e.status, "max_abs_err": e.max_abs_err,
                         "reason": e.reason})  # fmt: skip
    return rows


# --------------------------------------------------------------------------------------------
# Sparse decode captures (DeepSeek V3.2 / V4): the same classes, the sentences a sparse replay needs
# --------------------------------------------------------------------------------------------

# production's kernel (meta backend) -> (the backend that replays it, what it is)
SPARSE_KERNELS = {"triton": ("triton", "SGLang's triton_fp8_attention_fwd"),
                  "aiter_sparse": ("aiter_sparse", "aiter's pa_decode_sparse"),
                  "tilelang": ("tilelang", "SGLang's tilelang dpsk_v4_fp8_attention_fwd"),
                  "flashmla": ("flashmla_sparse", "FlashMLA's sparse decode (flash_mla_with_kvcache with indices)")}  # fmt: skip
SPARSE_DECODE = ("the sparse decode kernel diverges ({bad}) while {agree} on the same captured inputs: "
                 "that kernel computes this input wrongly")  # fmt: skip
SPARSE_DECODE_ALONE = ("the sparse decode kernel diverges ({bad}); no other path agrees on the same captured "
                       "inputs, so a problem in the inputs they share is not excluded")  # fmt: skip
SPARSE_UNREPLAYED = ("only the production output diverges, and {why}. The offline paths that ran ({agree}) are "
                     "other kernels, so this is not evidence of a state or transfer problem")  # fmt: skip


def sparse_unreplayed(produced_by: Optional[str], entries: Mapping[str, Any]) -> Optional[str]:
    """Why production's sparse kernel (meta backend) was not replayed, or None (it was, or it is none
    refmla knows). ``entries``: backend name -> BackendEntry."""
    if produced_by not in SPARSE_KERNELS:
        return None
    name, what = SPARSE_KERNELS[produced_by]
    who = "FlashMLA" if produced_by == "flashmla" else what
    e = entries.get(name)
    if e is None:
        return f"production ran {who} ({produced_by}), not replayed here (add --backend {name})"
    if e.status in ("skipped", "error"):
        return f"production ran {who} ({produced_by}), not replayed here: {e.reason or e.status}"
    return None


def diagnose_sparse(entries: Mapping[str, Any], produced_by: Optional[str] = None) -> Diagnosis:
    """The Diagnosis of a sparse replay from its entries (name -> BackendEntry): class and backends as
    :func:`diagnose` decides them; a sparse kernel replayed here that diverges is ``decode``; an
    ``observed`` divergence names production's kernel when it was not replayed here."""
    statuses = {n: e.status for n, e in entries.items() if n != "reference"}
    explained = {n: (e.explanation.hypothesis, e.explanation.detail) for n, e in entries.items()
                 if e.status == "fail" and e.explanation is not None and e.explanation.complete}  # fmt: skip
    failed = [n for n, s in statuses.items() if s == "fail"]
    base = diagnose(statuses, explained=explained)
    kernels = [n for n in statuses if n != "observed"]
    if base.name == "decode":
        bad = [n for n in failed if n in kernels]
        agree = [n for n in (*kernels, "observed") if statuses.get(n) == "pass"]
        who = " and ".join("the production output" if n == "observed" else n for n in agree)
        text = (SPARSE_DECODE.format(bad=", ".join(bad), agree=who + (" agree" if len(agree) > 1 else " agrees"))
                if agree else SPARSE_DECODE_ALONE.format(bad=", ".join(bad)))  # fmt: skip
        base = Diagnosis("decode", text, bad + (["observed"] if "observed" in failed else []))
    elif base.name in ("observed", "observed_unconfirmed"):
        why = sparse_unreplayed(produced_by, entries)
        agree = [n for n in kernels if statuses[n] == "pass"]
        if why and agree:
            base = Diagnosis("observed", SPARSE_UNREPLAYED.format(why=why, agree=", ".join(agree)), ["observed"])
        elif why:
            base = Diagnosis(base.name, f"{base.text}; {why}", base.backends, base.causes)
    said = "; ".join(f"{n}: {e.explanation.text()}" for n, e in entries.items() if e.explanation and e.status == "fail")
    return Diagnosis(base.name, base.text + (f"; {said}" if said else ""), base.backends, base.causes)
