"""Which serving engines and kernel packages are installed, and which kernel each backend runs.

``refmla doctor`` prints both: the engines (SGLang, vLLM) and kernel packages by their installed
distribution versions (read from package metadata: nothing is imported), and for every backend the
engine it belongs to and the kernel function it calls.
"""

from __future__ import annotations

from dataclasses import dataclass

# shown name -> distribution names to look up, first found wins
PACKAGES = {
    "sglang": ("sglang",), "vllm": ("vllm",), "aiter": ("amd-aiter", "aiter"), "triton": ("triton",),
    "flashinfer": ("flashinfer-python", "flashinfer"), "flash_mla": ("flash-mla", "flash_mla"),
    "sgl_kernel": ("sgl-kernel", "sgl_kernel"), "torch": ("torch",),
}  # fmt: skip


@dataclass(frozen=True)
class KernelOf:
    engine: str  # the engine or package the kernel comes from
    kernel: str  # the function called


KERNELS = {
    "reference": KernelOf("refmla", "refmla.reference.mla_decode_ref (fp64)"),
    "observed": KernelOf("capture", "the capture's own out"),
    "triton": KernelOf("sglang", "decode_attention_fwd (Triton)"),
    "aiter": KernelOf("aiter", "mla_decode_fwd / mla_prefill_fwd"),
    "extend": KernelOf("sglang", "extend_attention_fwd (Triton)"),
    "triton_decode_per_query": KernelOf("sglang", "decode_attention_fwd per verify query"),
    "aiter_decode_per_query": KernelOf("aiter", "mla_decode_fwd per verify query"),
    "flex": KernelOf("torch", "flex_attention (Inductor)"),
    "vllm_triton": KernelOf("vllm", "decode_attention_fwd (TRITON_MLA, block table)"),
    "flashmla": KernelOf("flash_mla | vllm", "flash_mla_with_kvcache (dense)"),
    "flashinfer_mla": KernelOf("flashinfer", "trtllm_batch_decode_with_kv_cache_mla"),
    "cutlass_mla": KernelOf("vllm | sgl_kernel", "sm100_cutlass_mla_decode | cutlass_mla_decode"),
    "fa3_mla": KernelOf("vllm", "vllm_flash_attn.flash_attn_varlen_func (q_v, FA3)"),
}


def package_versions() -> dict[str, str]:
    """shown name -> installed version, or "absent"."""
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for shown, dists in PACKAGES.items():
        found[shown] = "absent"
        for dist in dists:
            try:
                found[shown] = version(dist)
                break
            except PackageNotFoundError:
                continue
    return found


__all__ = ["KERNELS", "KernelOf", "PACKAGES", "package_versions"]
