"""Finding SGLang's attention backends by version, wrapping their forward, reading what ran.

Where things live (checked against SGLang 0.5.23; older paths kept as fall-backs):

| what | module | name |
| --- | --- | --- |
| Triton backend | ``sglang.srt.layers.attention.triton_backend`` | ``TritonAttnBackend`` |
| aiter backend | ``sglang.srt.layers.attention.aiter_backend`` | ``AiterAttnBackend`` |
| Triton decode kernel | ``sglang.kernels.ops.attention.decode_attention`` (0.5.16+), ``sglang.srt.layers.attention.triton_ops.decode_attention`` (before) | ``_mla_launch_plan``, ``_decode_lean_attention_fwd`` (probed, optional) |
| graph-capture flag | ``sglang.srt.model_executor.runner_utils.capture_mode`` (0.5.x), ``sglang.srt.model_executor.cuda_graph_runner`` (0.4.x) | ``get_is_capture_mode`` |

The modules are patched when they are imported (a ``sys.meta_path`` post-import hook), or at once
when they already are; nothing of SGLang is imported by the hook itself. ``forward_decode`` and
``forward_extend`` take ``(q, k, v, layer, forward_batch, save_kv_cache=True, ...)`` in every
release seen, but gained and lost trailing parameters (``sinks``, ``score_mod``, ...); the
wrapper therefore finds ``q``, ``k``, ``layer``, ``forward_batch`` and ``sinks`` by name through
the original's signature and passes every argument through untouched.

What the wrapper does, per call:

1. inactive (stopped, disabled) -> straight to the original;
2. before the kernel: skip during CUDA/HIP graph capture or ``torch.compile`` tracing, and skip
   by layer, rank, mode and ``EVERY`` (no device work, no sync);
3. the original runs, its result is returned as it is;
4. after it: read (never write) the backend's ``forward_metadata``, the KV pool and the request
   pool, check the call is an absorbed-MLA call the capture format can describe, estimate the
   size, check the budget, copy to host, write. Any exception disables the hook, once, logged.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import inspect
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from refmla.hook.config import HookConfig
from refmla.hook.writer import HookState, capture_name

# backend name -> [(module, class)], newest first
BACKEND_CLASSES: dict[str, tuple[tuple[str, str], ...]] = {
    "triton": (("sglang.srt.layers.attention.triton_backend", "TritonAttnBackend"),),
    "aiter": (("sglang.srt.layers.attention.aiter_backend", "AiterAttnBackend"),),
}
DECODE_KERNEL_MODULES = (
    "sglang.kernels.ops.attention.decode_attention",
    "sglang.srt.layers.attention.triton_ops.decode_attention",
)
CAPTURE_MODE_PROBES = (
    ("sglang.srt.model_executor.runner_utils.capture_mode", "get_is_capture_mode"),
    ("sglang.srt.model_executor.cuda_graph_runner", "get_is_capture_mode"),
)
METHODS = {"decode": "forward_decode", "extend": "forward_extend"}
_MARK = "__refmla_hook__"  # set on our wrappers; holds the original

GRAPH_NOTE = (
    "a CUDA/HIP graph is being captured: the hook does nothing inside graph capture, and decode "
    "steps replayed from a graph never reach Python, so they are invisible to it. Run the server "
    "with --disable-cuda-graph to capture decode."
)


class Skip(Exception):
    """The call is not captured; the message says why (counted and logged once per reason)."""


# ---------------------------------------------------------------------------------------------
# Installed state
# ---------------------------------------------------------------------------------------------


@dataclass
class _Installed:
    state: HookState
    finder: Optional["_PostImportFinder"] = None
    patched: list[tuple[type, str, Callable]] = field(default_factory=list)  # (class, method, original)
    kernel_patched: list[tuple[Any, str, Callable]] = field(default_factory=list)  # (module, attr, original)


_INSTALLED: Optional[_Installed] = None
_TLS = threading.local()  # per-thread notes from the kernel probes of the current call


def current_state() -> Optional[HookState]:
    return _INSTALLED.state if _INSTALLED is not None else None


def install(cfg: HookConfig) -> HookState:
    """Install the hook for ``cfg`` in this process (idempotent; a second call keeps the first)."""
    global _INSTALLED
    if _INSTALLED is not None:
        return _INSTALLED.state
    os.makedirs(cfg.out_dir, exist_ok=True)
    inst = _Installed(state=HookState(cfg))
    _INSTALLED = inst
    targets: dict[str, Callable[[Any], None]] = {}
    for backend in sorted(cfg.backends):
        for module, cls_name in BACKEND_CLASSES[backend]:
            targets[module] = _make_backend_patcher(backend, cls_name)
    if "triton" in cfg.backends:
        for module in DECODE_KERNEL_MODULES:
            targets[module] = _patch_kernel_module
    inst.finder = _PostImportFinder(targets)
    sys.meta_path.insert(0, inst.finder)
    for module, patch in targets.items():  # already imported: patch now
        mod = sys.modules.get(module)
        if mod is not None:
            inst.finder.run_callback(module, mod)
    inst.state.log.info(
        "capture hook active: dir=%s layers=%s modes=%s min_seq_len=%d ranks=%s backends=%s every=%d "
        "max_files=%d max_bytes=%d partials=%s",
        cfg.out_dir, "all" if cfg.layers is None else sorted(cfg.layers), ",".join(sorted(cfg.modes)),
        cfg.min_seq_len, "all" if cfg.ranks is None else sorted(cfg.ranks), ",".join(sorted(cfg.backends)),
        cfg.every, cfg.max_files, cfg.max_bytes, cfg.partials,
    )  # fmt: skip
    return inst.state


def uninstall() -> None:
    """Restore every patched method and kernel-module attribute and drop the import hook."""
    global _INSTALLED
    inst = _INSTALLED
    if inst is None:
        return
    if inst.finder is not None and inst.finder in sys.meta_path:
        sys.meta_path.remove(inst.finder)
    for cls, name, original in reversed(inst.patched):
        setattr(cls, name, original)
    for mod, attr, original in reversed(inst.kernel_patched):
        setattr(mod, attr, original)
    _INSTALLED = None


def patched_methods() -> list[str]:
    """``module.Class.method`` of every method wrapped now."""
    if _INSTALLED is None:
        return []
    return [f"{c.__module__}.{c.__qualname__}.{n}" for c, n, _ in _INSTALLED.patched]


# ---------------------------------------------------------------------------------------------
# Post-import hook
# ---------------------------------------------------------------------------------------------


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """Runs a callback right after one of the target modules has been executed.

    For any other module ``find_spec`` returns None after one dict lookup, so the cost for the
    rest of the process is nil. The callback is guarded: an exception in it disables the hook.
    """

    def __init__(self, targets: dict[str, Callable[[Any], None]]):
        self.targets = dict(targets)
        self._busy: set[str] = set()
        self._done: set[str] = set()

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in self.targets or fullname in self._busy:
            return None
        self._busy.add(fullname)
        try:
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
            else:
                return None
        finally:
            self._busy.discard(fullname)
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _CallbackLoader(spec.loader, lambda mod: self.run_callback(fullname, mod))
        return spec

    def run_callback(self, fullname: str, module: Any) -> None:
        if fullname in self._done:
            return
        self._done.add(fullname)
        state = current_state()
        try:
            self.targets[fullname](module)
        except Exception as e:  # never let the hook break an import of SGLang
            if state is not None:
                state.fail(e)


class _CallbackLoader(importlib.abc.Loader):
    """Delegates to the real loader, then calls back with the executed module."""

    def __init__(self, inner, callback):
        self._inner, self._callback = inner, callback

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        self._inner.exec_module(module)
        self._callback(module)

    def __getattr__(self, name):  # get_source, get_code, is_package, get_resource_reader, ...
        return getattr(self._inner, name)


# ---------------------------------------------------------------------------------------------
# Patching
# ---------------------------------------------------------------------------------------------


def _make_backend_patcher(backend: str, cls_name: str) -> Callable[[Any], None]:
    def patch(module) -> None:
        inst = _INSTALLED
        if inst is None:
            return
        cls = getattr(module, cls_name, None)
        if cls is None:
            inst.state.once(f"nocls:{module.__name__}", logging.WARNING,
                            "%s has no %s in this SGLang: %s backend not captured", module.__name__, cls_name, backend)  # fmt: skip
            return
        for mode in sorted(inst.state.cfg.modes):
            _wrap_method(inst, cls, METHODS[mode], backend, mode)

    return patch


def _wrap_method(inst: _Installed, cls: type, name: str, backend: str, mode: str) -> None:
    original = cls.__dict__.get(name)
    if original is None or getattr(original, _MARK, None) is not None:
        return
    try:
        params = list(inspect.signature(original).parameters)
    except (TypeError, ValueError):
        params = []
    needed = ("q", "layer", "forward_batch")
    if params[:1] != ["self"] or any(p not in params for p in needed):
        inst.state.once(f"sig:{cls.__qualname__}.{name}", logging.WARNING,
                        "%s.%s has an unknown signature %s: not captured", cls.__qualname__, name, params)  # fmt: skip
        return
    pos = {p: i - 1 for i, p in enumerate(params) if i > 0}  # argument name -> index in *args

    def arg(args: tuple, kwargs: dict, pname: str, default: Any = None) -> Any:
        if pname in kwargs:
            return kwargs[pname]
        i = pos.get(pname)
        return args[i] if i is not None and i < len(args) else default

    def wrapper(self, *args, **kwargs):
        inst_now = _INSTALLED
        state = inst_now.state if inst_now is not None else None
        if state is None or not state.active:
            return original(self, *args, **kwargs)
        call = None
        try:
            call = _before(state, backend, mode, arg(args, kwargs, "layer"), arg(args, kwargs, "forward_batch"))
        except Exception as e:
            state.fail(e)
        if call is None:
            return original(self, *args, **kwargs)
        _TLS.notes = {}
        result = original(self, *args, **kwargs)
        try:
            call.q = arg(args, kwargs, "q")
            call.k = arg(args, kwargs, "k")
            call.sinks = arg(args, kwargs, "sinks")
            call.notes = getattr(_TLS, "notes", {}) or {}
            _after(state, call, self, result)
        except Skip as s:
            state.skip(str(s))
        except Exception as e:
            state.fail(e)
        finally:
            _TLS.notes = {}
        return result

    wrapper.__name__ = getattr(original, "__name__", name)
    wrapper.__qualname__ = getattr(original, "__qualname__", name)
    wrapper.__doc__ = getattr(original, "__doc__", None)
    wrapper.__wrapped__ = original  # type: ignore[attr-defined]
    setattr(wrapper, _MARK, original)
    setattr(cls, name, wrapper)
    inst.patched.append((cls, name, original))
    inst.state.log.info("wrapped %s.%s.%s (%s)", cls.__module__, cls.__qualname__, name, backend)


def _patch_kernel_module(module) -> None:
    """Record which decode path the Triton kernel took: the gfx950 batch-wide split count, Lean.

    ``decode_attention_fwd`` looks these helpers up in its module at call time, so wrapping the
    module attributes sees every call. Both probes only note their result for the current thread.
    """
    inst = _INSTALLED
    if inst is None:
        return
    plan = getattr(module, "_mla_launch_plan", None)
    if callable(plan) and getattr(plan, _MARK, None) is None:

        def mla_launch_plan(*args, **kwargs):
            tuned, forced = plan(*args, **kwargs)
            notes = getattr(_TLS, "notes", None)
            if notes is not None:
                notes["mla_tuned"], notes["forced_kv_splits"] = bool(tuned), int(forced)
            return tuned, forced

        setattr(mla_launch_plan, _MARK, plan)
        module._mla_launch_plan = mla_launch_plan
        inst.kernel_patched.append((module, "_mla_launch_plan", plan))
    lean = getattr(module, "_decode_lean_attention_fwd", None)
    if callable(lean) and getattr(lean, _MARK, None) is None:

        def decode_lean_attention_fwd(*args, **kwargs):
            notes = getattr(_TLS, "notes", None)
            if notes is not None:
                notes["lean"] = True
            return lean(*args, **kwargs)

        setattr(decode_lean_attention_fwd, _MARK, lean)
        module._decode_lean_attention_fwd = decode_lean_attention_fwd
        inst.kernel_patched.append((module, "_decode_lean_attention_fwd", lean))


# ---------------------------------------------------------------------------------------------
# Before the kernel: cheap filters only (no device work)
# ---------------------------------------------------------------------------------------------


@dataclass
class _Call:
    backend: str
    mode: str
    layer: Any
    forward_batch: Any
    layer_id: int
    step: int
    rank: int
    q: Any = None
    k: Any = None
    sinks: Any = None
    notes: dict = field(default_factory=dict)


_capture_probes: Optional[list[Callable[[], bool]]] = None
_rank_cache: Optional[int] = None


def graph_capturing() -> bool:
    """True while a CUDA/HIP graph is being captured (torch's stream state or SGLang's flag)."""
    import torch

    try:
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return True
    except Exception:
        pass
    for probe in _capture_mode_probes():
        try:
            if probe():
                return True
        except Exception:
            pass
    return False


def _capture_mode_probes() -> list[Callable[[], bool]]:
    global _capture_probes
    if _capture_probes is None:
        found = []
        for module, attr in CAPTURE_MODE_PROBES:
            mod = sys.modules.get(module)
            if mod is None:
                try:
                    mod = importlib.import_module(module)  # light; imported by the runner anyway
                except Exception:
                    continue
            fn = getattr(mod, attr, None)
            if callable(fn):
                found.append(fn)
        _capture_probes = found
    return _capture_probes


def _compiling() -> bool:
    try:
        import torch

        return bool(torch.compiler.is_compiling())
    except Exception:
        return False


def tp_rank() -> int:
    """This process's tensor-parallel rank, asked of SGLang in the ways its releases offer."""
    global _rank_cache
    if _rank_cache is not None:
        return _rank_cache
    getters = []
    try:
        from sglang.srt.runtime_context import get_parallel  # 0.5.2x

        getters += [lambda: get_parallel().tp_rank, lambda: get_parallel().attn_tp_rank]
    except Exception:
        pass
    try:
        from sglang.srt.distributed import get_tensor_model_parallel_rank  # 0.4.x - 0.5.x

        getters.append(get_tensor_model_parallel_rank)
    except Exception:
        pass
    for g in getters:
        try:
            _rank_cache = int(g())
            return _rank_cache
        except Exception:
            continue
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            _rank_cache = int(dist.get_rank())
            return _rank_cache
    except Exception:
        pass
    return 0


def _before(state: HookState, backend: str, mode: str, layer, forward_batch) -> Optional[_Call]:
    cfg = state.cfg
    if graph_capturing():
        state.once("graph", logging.WARNING, GRAPH_NOTE)
        return None
    if _compiling():
        state.once("compile", logging.WARNING, "torch.compile is tracing the attention backend: not captured there")
        return None
    layer_id = int(getattr(layer, "layer_id", -1))
    step = state.next_step(backend, layer_id)
    if not cfg.wants_layer(layer_id) or step % cfg.every:
        return None
    rank = tp_rank()
    if not cfg.wants_rank(rank):
        return None
    fm = getattr(forward_batch, "forward_mode", None)
    if mode == "extend" and fm is not None and hasattr(fm, "is_target_verify") and fm.is_target_verify():
        state.skip("target-verify (speculative) extend: its tree mask is not in refmla.capture/1")
        return None
    if cfg.min_seq_len > 0:
        longest = _longest_seq_len(forward_batch)
        if longest is not None and longest < cfg.min_seq_len:
            return None
    return _Call(backend=backend, mode=mode, layer=layer, forward_batch=forward_batch,
                 layer_id=layer_id, step=step, rank=rank)  # fmt: skip


def _longest_seq_len(forward_batch) -> Optional[int]:
    """max(seq_lens) from the host copy when there is one (no device sync), else from the device."""
    cpu = getattr(forward_batch, "seq_lens_cpu", None)
    try:
        if cpu is not None and cpu.numel():
            return int(cpu.max())
        dev = getattr(forward_batch, "seq_lens", None)
        if dev is not None and dev.numel():
            return int(dev.max())
    except Exception:
        return None
    return None


# ---------------------------------------------------------------------------------------------
# After the kernel: read what ran, check it, budget, copy, write
# ---------------------------------------------------------------------------------------------


def _versions() -> dict[str, str]:
    out = {}
    try:
        from importlib.metadata import version

        out["sglang_version"] = version("sglang")
    except Exception:
        mod = sys.modules.get("sglang")
        if mod is not None and getattr(mod, "__version__", None):
            out["sglang_version"] = str(mod.__version__)
    aiter = sys.modules.get("aiter")  # never imported by us: only report what the server loaded
    if aiter is not None:
        v = getattr(aiter, "__version__", None)
        if not v:
            try:
                from importlib.metadata import version

                v = version("amd-aiter")
            except Exception:
                v = None
        if v:
            out["aiter_version"] = str(v)
    try:
        import triton

        out["triton_version"] = str(triton.__version__)
    except Exception:
        pass
    return out


def _scale(layer, name: str) -> float:
    """k_scale / v_scale as the kernel applies them (``layer.k_scale_float``), 1.0 when unset."""
    if getattr(layer, name, None) is None:
        return 1.0
    value = getattr(layer, name + "_float", None)
    if value is None:
        value = getattr(layer, name)
        value = float(value.item()) if hasattr(value, "item") else float(value)
    return float(value)


def _gather_rows(buf, rows):
    """``buf[rows]`` for a pool view of any dtype (fp8 gathered through its uint8 bytes)."""
    import torch

    rows = rows.to(buf.device)
    if buf.element_size() == 1 and buf.dtype not in (torch.uint8, torch.int8):
        return buf.view(torch.uint8).index_select(0, rows).view(buf.dtype)
    return buf.index_select(0, rows)


def _after(state: HookState, call: _Call, backend_obj, result) -> None:
    import torch

    cfg = state.cfg
    layer, fb = call.layer, call.forward_batch
    md = getattr(backend_obj, "forward_metadata", None)
    if md is None:
        raise Skip("backend has no forward_metadata")
    H = int(layer.tp_q_head_num)
    D = int(layer.qk_head_dim)
    Dv = int(layer.v_head_dim)
    pool = backend_obj.token_to_kv_pool
    kv_lora_rank = int(getattr(pool, "kv_lora_rank", Dv))
    if Dv != kv_lora_rank or D <= Dv or int(getattr(layer, "tp_k_head_num", 1)) != 1:
        raise Skip(f"not an absorbed-MLA call (qk_head_dim={D}, v_head_dim={Dv}, kv_lora_rank={kv_lora_rank})")
    sw = getattr(layer, "sliding_window_size", None)
    if sw is not None and sw > -1:
        raise Skip("sliding-window layer")
    if int(getattr(backend_obj, "dcp_size", 1) or 1) > 1 or int(getattr(backend_obj, "dcp_world_size", 1) or 1) > 1:
        raise Skip("decode context parallelism (dcp_size > 1)")
    if call.sinks is not None or (getattr(layer, "xai_temperature_len", -1) or -1) > 0:
        raise Skip("attention sinks / xai temperature are not in refmla.capture/1")
    if call.q is None or result is None or not torch.is_tensor(result):
        raise Skip("no q or no output tensor")

    q = call.q.reshape(-1, H, D)  # [B, H, D] decode / [T, H, D] extend; a view, never written
    out = result.reshape(-1, H, Dv)  # [B, H, Dv] / [T, H, Dv]
    if out.shape[0] != q.shape[0]:
        raise Skip(f"output rows {out.shape[0]} != query rows {q.shape[0]}")
    T = q.shape[0]

    kv_indptr, kv_indices, qo_indptr, B = _read_indices(call, md, fb, T)  # host, small
    seq_lens = (kv_indptr[1:] - kv_indptr[:-1]).to(torch.int32)  # [B] what the kernel attended
    if B and int(seq_lens.max()) < cfg.min_seq_len:
        return  # below the threshold once measured exactly (the pre-check used the batch's lens)

    notes: dict[str, Any] = {}
    server_lens = getattr(fb, "seq_lens", None)
    if server_lens is not None and server_lens.shape[0] >= B:
        sl = server_lens[:B].to("cpu", torch.int64)
        if not torch.equal(sl, seq_lens.long()):
            notes["seq_lens_mismatch"] = True
            notes["server_seq_lens"] = sl.tolist()

    k_buf = pool.get_key_buffer(layer.layer_id)  # [N, 1, D]; read only
    if k_buf.dim() != 3 or k_buf.shape[1] != 1 or k_buf.shape[2] != D:
        raise Skip(f"KV pool buffer shape {list(k_buf.shape)} is not [N, 1, {D}]")
    N = k_buf.shape[0]
    if kv_indices.numel() and (int(kv_indices.min()) < 0 or int(kv_indices.max()) >= N):
        raise Skip("kv_indices out of the pool's range")

    req_to_token = None
    r2t_src = getattr(backend_obj, "req_to_token", None)
    rpi = getattr(fb, "req_pool_indices", None)
    if r2t_src is not None and rpi is not None and rpi.shape[0] >= B and B:
        M = int(seq_lens.max())
        req_to_token = r2t_src[:, :M].index_select(0, rpi[:B].to(r2t_src.device).long()).to("cpu")

    num_kv_splits = attn_logits = attn_lse = None
    if call.backend == "triton" and call.mode == "decode":
        num_kv_splits, attn_logits, attn_lse = _triton_schedule(call, md, B, H, cfg.partials, notes)
    elif call.backend == "aiter" and isinstance(getattr(md, "num_kv_splits", None), int):
        notes["aiter_num_kv_splits"] = md.num_kv_splits
    if call.mode == "extend":
        _check_new_rows(call, k_buf, fb, T)

    # ---- budget, from sizes alone ----
    used = [kv_indices]
    if req_to_token is not None:
        live = torch.arange(req_to_token.shape[1])[None, :] < seq_lens[:, None]  # [B, M]
        used.append(req_to_token.long()[live & (req_to_token >= 0) & (req_to_token < N)])
    rows = torch.unique(torch.cat(used))  # sorted physical slots the capture keeps
    estimate = (q.numel() * q.element_size() + out.numel() * out.element_size()
                + rows.numel() * D * k_buf.element_size() + 8 * (3 * kv_indices.numel() + 3 * B + 2)
                + (req_to_token.numel() * 8 if req_to_token is not None else 0)
                + (attn_logits.numel() * 4 + attn_lse.numel() * 4 if attn_logits is not None else 0)
                + 4096)  # fmt: skip
    if not state.admit(estimate):
        return

    # ---- copy off the device (reads only), the pool compacted to the referenced rows ----
    tensors = {
        "q": q.detach().to("cpu"),
        "kv_buffer": _gather_rows(k_buf, rows).to("cpu"),  # only the referenced rows
        "kv_indptr": kv_indptr,
        "kv_indices": torch.searchsorted(rows, kv_indices),
        "orig_kv_indices": kv_indices,
        "seq_lens": seq_lens,
        "out": out.detach().to("cpu"),
    }
    if req_to_token is not None:
        tensors["req_to_token"] = _remap_req_to_token(req_to_token, rows, seq_lens)
    if qo_indptr is not None:
        tensors["qo_indptr"] = qo_indptr
    if num_kv_splits is not None:
        tensors["num_kv_splits"] = num_kv_splits
    if attn_logits is not None:
        al = attn_logits.detach().to("cpu", torch.float32).clone()
        ae = attn_lse.detach().to("cpu", torch.float32).clone()
        _blank_empty_splits(al, ae, seq_lens, num_kv_splits)
        tensors["attn_logits"], tensors["attn_lse"] = al, ae

    meta = {
        "mode": call.mode,
        "backend": call.backend,
        "kv_lora_rank": kv_lora_rank,
        "qk_rope_head_dim": D - kv_lora_rank,
        "sm_scale": float(layer.scaling),
        "logit_cap": float(getattr(layer, "logit_cap", 0.0) or 0.0),
        "page_size": int(getattr(backend_obj, "page_size", None) or getattr(pool, "page_size", 1) or 1),
        "k_scale": _scale(layer, "k_scale"),
        "v_scale": _scale(layer, "v_scale"),
        "layer_id": call.layer_id,
        "tp_rank": call.rank,
        "step": call.step,
        **_versions(),
        "capture_tool": _tool_version(),
        "sglang_class": f"{type(backend_obj).__module__}.{type(backend_obj).__qualname__}",
        "forward_mode": _mode_name(getattr(fb, "forward_mode", None)),
        "pid": os.getpid(),
        "captured_at": time.time(),
        "kv_pool_dtype": str(k_buf.dtype).replace("torch.", ""),
        **notes,
    }
    if call.backend == "triton" and call.mode == "decode" and getattr(backend_obj, "max_kv_splits", None):
        meta["max_kv_splits"] = int(backend_obj.max_kv_splits)
    rids = getattr(fb, "rids", None)
    if rids is not None and len(rids) >= B:
        meta["rids"] = [str(r) for r in list(rids)[:B]]
    name = capture_name(mode=call.mode, rank=call.rank, layer=call.layer_id, step=call.step,
                        backend=call.backend, pid=os.getpid())  # fmt: skip
    state.write(name, tensors, meta)


def _read_indices(call: _Call, md, fb, T: int):
    """(kv_indptr [B+1], kv_indices (physical slots), qo_indptr or None, B) on the host, int64.

    decode: exactly what the kernel read (``forward_metadata.kv_indptr / kv_indices``).
    extend: the kernel read the prefix from the metadata and the new tokens from ``k``; the
    capture format wants the whole sequence, so each request's new-token slots
    (``forward_batch.out_cache_loc``, where the call wrote them) follow its prefix.
    """
    import torch

    if call.mode == "decode":
        B = T
        kv_indptr = md.kv_indptr[: B + 1].to("cpu", torch.int64)  # [B + 1]
        if kv_indptr.shape[0] != B + 1:
            raise Skip(f"kv_indptr has {kv_indptr.shape[0]} entries for {B} requests")
        kv_indices = md.kv_indices[int(kv_indptr[0]) : int(kv_indptr[-1])].to("cpu", torch.int64)
        return kv_indptr - kv_indptr[0], kv_indices, None, B
    if getattr(md, "custom_mask", None) is not None:
        raise Skip("extend with a custom mask (speculative tree): not in refmla.capture/1")
    qo = getattr(md, "qo_indptr", None)
    if qo is None or getattr(md, "kv_indices", None) is None or md.kv_indices.dim() != 1:
        raise Skip("extend metadata without token-level qo_indptr / kv_indices")
    B = int(fb.batch_size)
    qo_indptr = qo[: B + 1].to("cpu", torch.int64)
    if int(qo_indptr[-1]) - int(qo_indptr[0]) != T:
        raise Skip(f"qo_indptr covers {int(qo_indptr[-1] - qo_indptr[0])} tokens, q has {T}")
    qo_indptr = qo_indptr - qo_indptr[0]
    pre_indptr = md.kv_indptr[: B + 1].to("cpu", torch.int64)
    pre_indices = md.kv_indices[int(pre_indptr[0]) : int(pre_indptr[-1])].to("cpu", torch.int64)
    pre_indptr = pre_indptr - pre_indptr[0]
    new_locs = fb.out_cache_loc[:T].to("cpu", torch.int64)  # [T] slots of the new tokens
    parts, lens = [], []
    for b in range(B):
        p = pre_indices[int(pre_indptr[b]) : int(pre_indptr[b + 1])]
        n = new_locs[int(qo_indptr[b]) : int(qo_indptr[b + 1])]
        parts += [p, n]
        lens.append(p.numel() + n.numel())
    kv_indices = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)
    kv_indptr = torch.zeros(B + 1, dtype=torch.int64)
    kv_indptr[1:] = torch.cumsum(torch.tensor(lens, dtype=torch.int64), 0)
    return kv_indptr, kv_indices, qo_indptr, B


def _check_new_rows(call: _Call, k_buf, fb, T: int) -> None:
    """extend: the pool rows at the new tokens' slots must hold the ``k`` the kernel used."""
    import torch

    k = call.k
    if k is None or k.dtype != k_buf.dtype or k.numel() != T * k_buf.shape[-1]:
        return  # k read back from the pool by the backend, or stored converted (fp8): nothing to check
    rows = _gather_rows(k_buf, fb.out_cache_loc[:T].long())  # [T, 1, D]
    if not torch.equal(rows.reshape(T, -1), k.reshape(T, -1)):
        raise Skip("extend: the pool does not hold this call's new K (written elsewhere or later)")


def _triton_schedule(call: _Call, md, B: int, H: int, partials: bool, notes: dict):
    """(num_kv_splits [B] int32, attn_logits [B,H,S,Dv] view, attn_lse [B,H,S] view) as the kernel used them.

    The kernel's own notes (from the probes on its module) say whether SGLang's gfx950 tuning
    replaced the per-request counts by one batch-wide count, or whether the Lean kernel ran
    (no splits, no partials). S is cut to the largest split count of the batch.
    """
    import torch

    sched = getattr(md, "num_kv_splits", None)
    if sched is None:
        return None, None, None
    sched = sched[:B].to("cpu", torch.int32)
    forced = int(call.notes.get("forced_kv_splits", 0) or 0)
    if call.notes.get("lean"):
        notes.update(decode_kernel="lean", sched_num_kv_splits=sched.tolist())
        return None, None, None
    if forced > 0:
        notes.update(sched_num_kv_splits=sched.tolist(), forced_kv_splits=forced)
        num_kv_splits = torch.full((B,), forced, dtype=torch.int32)
    else:
        num_kv_splits = sched
    notes["decode_kernel"] = "grouped_mla_tuned" if call.notes.get("mla_tuned") else ("grouped" if H > 1 else "normal")
    logits, lse = getattr(md, "attn_logits", None), getattr(md, "attn_lse", None)
    if not partials or logits is None or lse is None:
        return num_kv_splits, None, None
    S = min(int(logits.shape[2]), max(int(num_kv_splits.max()) if B else 1, 1))
    return num_kv_splits, logits[:B, :, :S], lse[:B, :, :S]


def _remap_req_to_token(req_to_token, rows, seq_lens):
    """req_to_token [B, M] in the compacted numbering of kv_indices; past a request's seq_len: -1."""
    import torch

    r2t = req_to_token.long()  # [B, M] physical slots
    pos = torch.searchsorted(rows, r2t.clamp(min=0)).clamp(max=max(rows.numel() - 1, 0))  # [B, M]
    hit = rows[pos] == r2t if rows.numel() else torch.zeros_like(r2t, dtype=torch.bool)
    keep = hit & (torch.arange(r2t.shape[1])[None, :] < seq_lens[:, None])
    return torch.where(keep, pos, -1).to(req_to_token.dtype)


def _blank_empty_splits(attn_logits, attn_lse, seq_lens, num_kv_splits) -> None:
    """NaN in the (host copy of the) splits stage 1 never wrote: their bytes are leftovers."""
    import torch

    from refmla.schedule import nonempty_splits_batch

    kernel = next((sys.modules[m] for m in DECODE_KERNEL_MODULES if m in sys.modules), None)
    filled = nonempty_splits_batch(seq_lens, num_kv_splits, int(getattr(kernel, "_MIN_BLOCK_KV", 32)))  # [B]
    S = attn_logits.shape[2]
    empty = filled[:, None] <= torch.arange(S)[None, :]  # [B, S]
    attn_logits[empty[:, None, :, None].expand_as(attn_logits)] = float("nan")
    attn_lse[empty[:, None, :].expand_as(attn_lse)] = float("nan")


def _tool_version() -> str:
    try:
        from refmla import __version__

        return f"refmla.hook {__version__}"
    except Exception:
        return "refmla.hook"


def _mode_name(fm) -> str:
    """SGLang's ForwardMode as a name (DECODE, EXTEND, ...), whatever enum kind it is."""
    return str(getattr(fm, "name", fm)) if fm is not None else ""
