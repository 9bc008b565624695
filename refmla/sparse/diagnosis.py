"""Which path of a sparse decode replay diverges, as the typed :class:`refmla.diagnosis.Diagnosis`
dense replay gives (the same classes, docs/contract.md section 6; the same JSON keys), with the
sentences a sparse replay needs: there is no extend baseline, the production kernel is named by
meta ``backend`` (aiter_sparse, tilelang, ...), and each failing path's explanation is appended.

    null / observed / observed_unconfirmed / decode / numerics / backend_error / metadata

``decode`` means a sparse decode kernel replayed here (triton, aiter_sparse, tilelang) diverges.
"""

from __future__ import annotations

from typing import Optional, Sequence

from refmla.diagnosis import SENTENCES, Diagnosis, diagnose

KERNEL_PATHS = ("triton", "aiter_sparse", "tilelang")
PAGED_KERNELS = {"aiter_sparse": "aiter's pa_decode_sparse", "tilelang": "SGLang's tilelang dpsk_v4_fp8_attention_fwd",
                 "triton": "SGLang's triton_fp8_attention_fwd"}  # fmt: skip
STATUS = {"pass": "pass", "FAIL": "fail", "skipped": "skipped", "error": "error"}

SPARSE_DECODE = ("the sparse decode kernel diverges ({bad}) while {agree} on the same captured inputs: "
                 "that kernel computes this input wrongly")  # fmt: skip
SPARSE_DECODE_ALONE = ("the sparse decode kernel diverges ({bad}); no other path agrees on the same captured "
                       "inputs, so a problem in the inputs they share is not excluded")  # fmt: skip


def _unreplayed(produced_by: Optional[str], entries: Sequence) -> Optional[str]:
    """Why the production kernel (meta backend) was not replayed, or None (replayed, or not a kernel here)."""
    if produced_by not in KERNEL_PATHS:
        return None
    e = next((e for e in entries if e.backend == produced_by), None)
    if e is None:
        return f"production ran {PAGED_KERNELS[produced_by]} ({produced_by}), not run here (add --backend {produced_by})"
    if e.status in ("skipped", "error"):
        return f"production ran {PAGED_KERNELS[produced_by]} ({produced_by}), not replayed here: {e.note or e.status}"
    return None


def _decode(statuses: dict, failed: list[str]) -> Diagnosis:
    bad = [n for n in failed if n in KERNEL_PATHS]
    agree = [n for n in (*KERNEL_PATHS, "observed") if statuses.get(n) == "pass"]
    about = bad + (["observed"] if "observed" in failed else [])
    if agree:
        who = " and ".join("the production output" if n == "observed" else n for n in agree)
        text = SPARSE_DECODE.format(bad=", ".join(bad), agree=who + (" agree" if len(agree) > 1 else " agrees"))
    else:
        text = SPARSE_DECODE_ALONE.format(bad=", ".join(bad))
    return Diagnosis("decode", text, about)


def diagnose_sparse(entries: Sequence, produced_by: Optional[str] = None) -> Diagnosis:
    """The Diagnosis of a sparse replay from its entries (refmla.sparse.replay.SparseEntry):
    class and backends as dense replay decides them; the sentence for a sparse capture, then each
    failing path's explanation (``; observed: sink omitted ...``)."""
    statuses = {e.backend: STATUS.get(e.status, e.status) for e in entries if e.backend != "reference"}
    explained = {e.backend: (e.explanation.hypothesis, e.explanation.detail) for e in entries if e.explanation}
    failed = [n for n, s in statuses.items() if s == "fail"]
    base = diagnose(statuses, explained=explained)
    if base.name == "decode":
        base = _decode(statuses, failed)
    elif base.name in ("observed", "observed_unconfirmed"):
        why = _unreplayed(produced_by, entries)
        base = Diagnosis(base.name, base.text + (f"; {why}" if why else ""), base.backends)
    ref = next((e for e in entries if e.backend == "reference"), None)
    if ref is not None and ref.status in ("FAIL", "error"):  # the fp64 truth itself failed: nothing else is judged
        base = Diagnosis("backend_error", SENTENCES["backend_error"].format(bad="reference"), ["reference"])
    why = "; ".join(f"{e.backend}: {e.explanation.text()}" for e in entries if e.explanation and e.status == "FAIL")
    return Diagnosis(base.name, base.text + (f"; {why}" if why else ""), base.backends)


def invalid_diagnosis() -> Diagnosis:
    return Diagnosis("metadata", SENTENCES["metadata"])


__all__ = ["KERNEL_PATHS", "diagnose_sparse", "invalid_diagnosis"]
