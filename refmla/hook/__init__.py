"""Capture from a live SGLang server: an env-gated hook on the Triton and aiter MLA backends, and on
DeepSeek-V4's sparse decode entrypoint (``REFMLA_CAPTURE_BACKENDS=dsv4``); and from a live vLLM
server: the same hook through vLLM's plugin entry point (``vllm_patch``).

Two ways to switch it on (see ``docs/capture.md``):

* ``refmla capture run --out DIR -- python -m sglang.launch_server ...`` runs the command with
  the hook active in it and in every Python process it spawns (a ``sitecustomize`` on
  ``PYTHONPATH``);
* without the wrapper: set ``REFMLA_CAPTURE_DIR=DIR`` and ``import refmla.hook`` once in the
  server process before it builds its attention backend. Importing this package installs the
  hook when (and only when) ``REFMLA_CAPTURE_DIR`` is set; :func:`install` does it explicitly.

With ``REFMLA_CAPTURE_DIR`` unset nothing is patched and nothing of torch or SGLang is imported:
the hook costs nothing. The other ``REFMLA_CAPTURE_*`` variables are described in
:mod:`refmla.hook.config`.

Inside the package (each module imports only modules above it in this list). The modules marked
(torch) import torch and refmla's tensor code; :mod:`refmla.hook.patching` loads them on the first
call that passes the filters. The rest are torch-free, as they run at interpreter start-up under
``refmla capture run``:

    config.py         REFMLA_CAPTURE_* -> HookConfig
    writer.py         HookState: budget, once-per-reason logging, fail/stop, atomic write
    sglang_paths.py   where SGLang keeps the backends, kernels and flags, release by release
    postimport.py     the sys.meta_path finder/loader: patch a module the moment it is imported
    runtime.py        probes: graph capture, torch.compile, TP rank, versions
    call.py           Skip, Call, Indices, CallContext: what the stages hand on
    requests.py       the scheduler's requests as ForwardBatch.init_new gets them: token ids and cache tiers per rid
    filters.py        before the kernel: the cheap filters (layer, rank, EVERY, mode, MIN_SEQ_LEN)
    kernel_probes.py  notes from inside SGLang's kernel module (gfx950 forced splits, Lean)
    tensors.py        (torch) pool rows gathered, slots renumbered, unwritten splits blanked
    nvidia.py         (torch) SGLang's NVIDIA MLA decode backends: the metadata, block table or plan
                      each read, the page size, the KV scales each applied, q from q + q_rope
    aiter_meta.py     (torch) the aiter path production ran (meta) and its persistent work buffers
    geometry.py       the production pool's geometry (rows, bytes per row, layers per buffer) for the meta
    meta.py           (torch) the meta providers and their assembly
    modes.py          (torch) one reader per capture mode (decode, extend): indices, kernel state
    sglang_dcp.py     (torch) SGLang's Triton decode under decode context parallelism: the rank's
                      gathered q, pre-merge partial and combine (from the kernel probes) as a rank capture
    extract.py        (torch) after the kernel: guards, reader, pool, budget, host copy, write
    patching.py       install / uninstall; the forward_decode / forward_extend wrapper; the DeepSeek-V4
                      sparse entrypoint's wrapper (REFMLA_CAPTURE_BACKENDS=dsv4)
    sparse_kv.py      (torch) DeepSeek-V4's KV map of a call: each cache's token per position, from SGLang's pool
    sparse_call.py    (torch) DeepSeek-V4 sparse decode: the entrypoint's keyword arguments as a sparse capture
    dsa_call.py       (torch) DeepSeek-V3.2 DSA's aiter decode on ROCm (_forward_aiter) as a dense decode capture
    indexer_call.py   (torch) DeepSeek-V3.2's indexer decode top-k (Indexer._get_topk_paged) as an indexer capture (dsa)
    c4_indexer_call.py  (torch) DeepSeek-V4's C4 indexer (C4IndexerBackendMixin.forward_c4_indexer and its
                      prepare steps) as an indexer capture, compress ratio 4 (dsv4)
    kvwrite_call.py   (torch) the MLA KV cache writers (SGLang's pool, aiter's fused write, vLLM's
                      concat_and_cache_mla): rows before and after the write (REFMLA_CAPTURE_BACKENDS=kvwrite)
    v4write_call.py   (torch) DeepSeek-V4's packed pool writers (a pack stored, or bf16 quantized into
                      UE8M0 tiles): each kept slot's page bytes before and after (kvwrite too)
    chunked_call.py   (torch) SGLang's chunked-prefix MHA prefill recorded whole around its core: each
                      attention piece's q, k, v, (out, lse) and each merge (REFMLA_CAPTURE_BACKENDS=merge)
    merge_call.py     (torch) the state merges (SGLang's merge_state*, vLLM's merge_attn_states), and the
                      wrapper for each writer / merge the patcher installs (REFMLA_CAPTURE_BACKENDS=merge)
    vllm_paths.py     where vLLM keeps its MLA Impl classes (forward_mqa), and their capture names
    vllm_patch.py     vLLM: the ``vllm.general_plugins`` entry point, install, the forward_mqa wrapper
    dcp_combine.py    (torch) vLLM's DCP combine (the layer's dcp_manager.combine): a rank's capture held
                      until it runs, then written with its inputs and output
    vllm_extract.py   (torch) vLLM: the kernel's block table, split count, pool pages -> a capture
    sitecustomize/    the start-up file that ``capture run`` puts first on PYTHONPATH

Where to extend it (each without touching the rest):

* another forward mode: a :class:`~refmla.hook.modes.ModeReader` in ``modes.READERS`` under the
  mode's name, and :func:`refmla.hook.filters.forward_kind` returning that name, as ``verify``
  does for speculative ``target_verify`` / ``draft_extend`` (several query tokens per request,
  ``qo_indptr``, SGLang's ``custom_mask`` + ``mask_indptr``);
* another meta group, e.g. KV pool geometry (pool row count, bytes per row, layers per registered
  buffer, disaggregation backend, ``SGLANG_MORI_MAX_MR_BYTES``): a provider (``CallContext ->
  dict``) appended to ``meta.META_PROVIDERS``, or to a mode reader's ``meta`` when mode-only;
* which kernel path SGLang dispatched, e.g. aiter's persistent / non-persistent / gluon MLA
  decode, head padding, env vars: a probe in ``kernel_probes.KERNEL_PROBES`` for the module that
  decides (it notes into ``Call.kernel_notes``), read by a meta provider such as ``meta.aiter_meta``;
* a new SGLang release that moved something: ``sglang_paths``.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

from refmla.hook.config import ENV_DIR, ConfigError, HookConfig

__all__ = ["ENV_DIR", "ConfigError", "HookConfig", "install", "uninstall", "installed", "status"]

_PATCHING = "refmla.hook.patching"  # looked up in sys.modules: asking about the hook never imports it


def install(cfg: Optional[HookConfig] = None, environ: Optional[Mapping[str, str]] = None) -> bool:
    """Install the hook in this process. Returns True when it is active.

    ``cfg`` defaults to :meth:`HookConfig.from_env`; with ``REFMLA_CAPTURE_DIR`` unset nothing
    happens and False is returned. A configuration error is logged (never raised) and leaves the
    hook off: a typo in a variable must not keep the server from starting.
    """
    from refmla.hook.writer import get_logger

    if cfg is None:
        try:
            cfg = HookConfig.from_env(environ)
        except ConfigError as e:
            get_logger().error("capture hook not installed: %s", e)
            return False
        if cfg is None:
            return False
    try:
        from refmla.hook import patching

        patching.install(cfg)
    except Exception as e:  # never break the process that imported us
        get_logger().error("capture hook not installed: %s: %s", type(e).__name__, e)
        return False
    return True


def uninstall() -> None:
    """Remove the hook: originals restored, import hook dropped (for tests and notebooks)."""
    import sys

    mod = sys.modules.get(_PATCHING)
    if mod is not None:
        mod.uninstall()


def installed() -> bool:
    import sys

    mod = sys.modules.get(_PATCHING)
    return bool(mod is not None and mod.current_state() is not None)


def status() -> Optional[dict[str, Any]]:
    """What this process's hook did so far (files, bytes, skips, why stopped), or None if off."""
    import sys

    mod = sys.modules.get(_PATCHING)
    state = mod.current_state() if mod is not None else None
    if state is None:
        return None
    return {**state.summary(), "patched": mod.patched_methods()}


def _auto_install() -> None:
    import os

    if os.environ.get(ENV_DIR, "").strip():
        install()


_auto_install()
