"""What every backend of one replay shares: the options, the fp64 reference and the control, computed once.

Used by the replay, the hypothesis search, the golden checks and the plots; it knows nothing of
any of them.
"""

from __future__ import annotations

from typing import Optional

import torch

from refmla import reference as ref
from refmla.backends.reference import reference_output
from refmla.capture import Capture
from refmla.compare import Comparison, compare, judged_dtype
from refmla.arithmetic import Arithmetic, producer_arithmetic
from refmla.control import capture_control, declared_inputs, mla_decode_split_control
from refmla.options import SEARCH_REQUEST_BYTES, ReplayOptions


class ReplayContext:
    """What every backend of one replay shares, computed at most once."""

    def __init__(self, cap: Capture, opts: ReplayOptions):
        self.cap, self.opts = cap, opts
        self.ref_out, self.ref_lse = reference_output(cap)  # [R, H, Dv], [R, H] fp64
        self.producer = producer_arithmetic(cap)  # the arithmetic of ``observed`` and of undeclared backends
        self._controls: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self._splits: dict[tuple, tuple] = {}

    def control(self, out_dtype: torch.dtype, arith: Optional[Arithmetic] = None, splits=None) -> torch.Tensor:
        """The low-precision control's output in ``out_dtype`` at the arithmetic a backend declares
        (default the capture producer's), over ``splits`` (default the capture's); cached."""
        return self._control(out_dtype, arith, splits)[0]

    def control_lse(self, out_dtype: torch.dtype, arith: Optional[Arithmetic] = None, splits=None) -> torch.Tensor:
        """The low-precision control's lse [R, H] (fp32), of the same run as :meth:`control`."""
        return self._control(out_dtype, arith, splits)[1]

    def _control(self, out_dtype: torch.dtype, arith: Optional[Arithmetic], splits) -> tuple[torch.Tensor, torch.Tensor]:
        arith = arith or self.producer
        splits = self.cap.num_kv_splits if splits is None else splits  # as capture_control defaults it
        key = (out_dtype, arith, None if splits is None or arith.split_block is None else tuple(splits.tolist()))
        if key not in self._controls:
            self._controls[key] = capture_control(self.cap, out_dtype, arith=arith, num_kv_splits=splits)
        return self._controls[key]

    def split_reference(self, num_kv_splits: torch.Tensor, S: int, control: bool = False,
                        arith: Optional[Arithmetic] = None):  # fmt: skip
        """(attn_logits, attn_lse, valid) of the split schedule a backend declares (default the
        producer's), reference or control (at the rounding points it declares)."""
        arith = arith or self.producer
        key = (tuple(num_kv_splits.tolist()), S, control, arith if control else arith.split_block)
        if key not in self._splits:
            c = self.cap
            q, sc, rnd = declared_inputs(c, arith, c.scales(), c.q) if control else (c.q, c.scales(), None)
            args = (q, c.kv_buffer, c.attended(), num_kv_splits.cpu(), sc)
            kw = dict(max_kv_splits=S, split_block=arith.split_block or c.split_block)
            self._splits[key] = mla_decode_split_control(*args, **kw, rounding=rnd) if control else ref.mla_decode_split_ref(*args, **kw)
        return self._splits[key]

    def too_large_to_search(self, b: int) -> Optional[str]:
        """Why request b is past the search's budget (SEARCH_REQUEST_BYTES), or None: its rows in
        fp64 and as stored [L, D], and its logits [T, H, L] in fp64."""
        att, q, kv = self.cap.attended(), self.cap.q, self.cap.kv_buffer
        L, T = int(att.indptr[b + 1] - att.indptr[b]), len(att.queries(b))
        need = L * kv.shape[-1] * (8 + kv.dtype.itemsize) + T * q.shape[1] * L * 8
        if need <= SEARCH_REQUEST_BYTES:
            return None
        return (f"request {b} attends {L} rows: searching it would hold {need / 2**30:.1f} GiB "
                f"(budget {SEARCH_REQUEST_BYTES / 2**30:.0f} GiB); not searched")  # fmt: skip

    def empty_rows(self) -> torch.Tensor:
        """[R] True where the row's request attends no token."""
        return (self.cap.seq_lens.long() == 0)[self.cap.request_of_row()]

    def compare(
        self, name: str, out: torch.Tensor, row_mask: Optional[torch.Tensor] = None, control: Optional[torch.Tensor] = None
    ) -> Comparison:
        """``out`` against the reference; ``control``: a backend's own noise floor (BackendResult.control)."""
        dtype = judged_dtype(out.dtype)
        ctl = self.control(dtype) if control is None else control.to(dtype)
        return compare(
            name, out, self.ref_out, ctl, out_dtype=dtype, tol=self.opts.tol,
            row_mask=row_mask, request_of_row=self.cap.request_of_row(),
        )  # fmt: skip


__all__ = ["ReplayContext", "ReplayOptions"]  # ReplayOptions: refmla.options, re-exported
