"""``cutlass_mla``: the CUTLASS MLA decode kernel (sm100, page 128), by its signature.

Two entry points, the first found is used: vLLM's ``vllm._custom_ops.sm100_cutlass_mla_decode(out,
lse, q_nope, q_pe, kv_c_and_k_pe_cache, seq_lens, page_table, workspace, scale, num_kv_splits)``
(writes out / lse) and sgl_kernel's ``cutlass_mla_decode(q_nope, q_pe, kv_c_and_k_pe_cache,
seq_lens, page_table, workspace, sm_scale, num_kv_splits)`` (returns out). Both want 128 query
heads (the callers pad H up to 128 and slice back), kv [pages, P, 576], int32 page_table with a
multiple of 128 / P columns, and a workspace sized by their ``*_get_workspace_size``. One KV
split is asked for (SGLang disabled CUTLASS split-KV: #6101).
"""

from __future__ import annotations

import torch

from refmla.backends.calling import find_function, kwargs_for
from refmla.backends.paged.inputs import PagedInputs, PagedKernelBackend, call_result, runs_here, unavailable_stub

ENTRIES = (  # (module, kernel, its workspace-size function)
    ("vllm._custom_ops", "sm100_cutlass_mla_decode", "sm100_cutlass_mla_get_workspace_size"),
    ("sgl_kernel", "cutlass_mla_decode", "cutlass_mla_get_workspace_size"),
)
HEADS = 128


class CutlassMLABackend(PagedKernelBackend):
    name = "cutlass_mla"
    what = "CUTLASS MLA decode"
    page_sizes = (128,)
    table_multiple = 1  # 128 / P with P = 128
    fp8_why = ("it takes no q / KV scales (vLLM's CutlassMLAImpl raises for q_scale or k_scale != 1), "
               "so its fp8 cache is not adapted")  # fmt: skip

    def locate(self, attr=None):
        """The first entry that imports and can run here, else the first that imports, else why not."""
        found, causes = [], []
        for module, attr, _ in ENTRIES:
            try:
                fn, where = find_function((module,), attr, self.what)
            except Exception as e:
                causes.append(str(e))
                continue
            why = unavailable_stub(fn, where)
            if why:
                causes.append(why)
            else:
                found.append((fn, where, attr))
        if not found:
            raise RuntimeError("; ".join(causes))
        fn, where, attr = next((f for f in found if runs_here(f[1])), found[0])
        self.modules, self.attr = (where,), attr
        return fn, where

    def call(self, fn, x: PagedInputs, cap):
        import sys

        m = cap.meta
        B, H, _ = x.q.shape
        if H > HEADS:
            raise ValueError(f"CUTLASS MLA takes at most {HEADS} heads, the capture has {H}")
        q = torch.zeros(B, HEADS, x.q.shape[2], dtype=x.q.dtype, device=x.q.device)
        q[:, :H] = x.q
        size_fn = getattr(sys.modules[fn.__module__], dict((a, w) for _, a, w in ENTRIES)[self.attr])
        sm_count = torch.cuda.get_device_properties(0).multi_processor_count if torch.cuda.is_available() else 1
        size = kwargs_for(size_fn, dict(max_seq_len=x.block_table.shape[1] * x.page_size, num_batches=B,
                                        sm_count=sm_count, num_kv_splits=1))  # fmt: skip
        workspace = torch.empty(int(size_fn(**size)), dtype=torch.uint8, device=x.q.device)
        out = torch.empty(B, HEADS, m.kv_lora_rank, dtype=x.q.dtype, device=x.q.device)
        lse = torch.empty(B, HEADS, dtype=torch.float32, device=x.q.device)
        values = dict(
            out=out, lse=lse, q_nope=q[..., : m.kv_lora_rank].contiguous(), q_pe=q[..., m.kv_lora_rank :].contiguous(),
            kv_c_and_k_pe_cache=x.pool, seq_lens=x.seq_lens, page_table=x.block_table, workspace=workspace,
            scale=m.sm_scale, sm_scale=m.sm_scale, num_kv_splits=1,
        )  # fmt: skip
        got, _ = call_result(fn(**kwargs_for(fn, values)), out)
        return got[:, :H], None


__all__ = ["CutlassMLABackend", "ENTRIES"]
