"""Adapters for the NVIDIA block-table MLA decode kernels, one module each, picked by name.

    inputs.py          a capture as a kernel's paged inputs: pool [pages, P, D], block table, seq_lens
                       (the capture's own table when its page size fits, else re-paged), and the
                       common backend (find the kernel by signature, refuse without a GPU, compare)
    flashmla.py        flashmla        FlashMLA dense decode (page 64): flash_mla_with_kvcache
    flashinfer_mla.py  flashinfer_mla  FlashInfer's TRT-LLM-gen / cute-dsl MLA decode (page 32 / 64)
    cutlass_mla.py     cutlass_mla     CUTLASS MLA (sm100, page 128): vLLM's sm100_cutlass_mla_decode,
                                       sgl_kernel's cutlass_mla_decode
    fa3_mla.py         fa3_mla         FlashAttention 3 with qv (the latent as V): flash_attn_varlen_func

Each kernel is called by keyword from its real signature (refmla.backends.calling); where it is
absent (no package, no CUDA device) the backend is ``skipped`` with the reason. Their contracts
are tested against stand-ins written from those signatures (tests/standins/).
"""
