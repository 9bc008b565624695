"""``refmla capture run [options] -- COMMAND...``: run a command with the capture hook active.

The command and every Python process it starts get ``REFMLA_CAPTURE_*`` in their environment and
``refmla/hook/sitecustomize`` (plus the folder holding the ``refmla`` package) first on
``PYTHONPATH``; the ``sitecustomize`` there installs the hook at interpreter start-up. The exit
code is the command's (128 + N when a signal N ended it). SIGINT / SIGTERM / SIGHUP are passed on
to the command, so Ctrl-C stops the server as it would without the wrapper.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Optional, Sequence

from refmla.hook.config import ENV_PREFIX, ConfigError, HookConfig, IdSet, parse_bytes, parse_int_set

SITE_DIR = Path(__file__).resolve().parents[1] / "hook" / "sitecustomize"
PACKAGE_PARENT = Path(__file__).resolve().parents[2]  # the folder that holds refmla/


def capture_env(cfg: HookConfig, base: Optional[dict[str, str]] = None) -> dict[str, str]:
    """The environment for the wrapped command: ``base`` + the hook's variables + PYTHONPATH."""
    env = dict(os.environ if base is None else base)
    for key in [k for k in env if k.startswith(ENV_PREFIX)]:
        del env[key]  # only what cfg says
    env.update(cfg.to_env())
    paths = [str(SITE_DIR), str(PACKAGE_PARENT)]
    old = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in paths]
    env["PYTHONPATH"] = os.pathsep.join(paths + old)
    return env


def run_with_capture(cmd: Sequence[str], cfg: HookConfig) -> int:
    """Run ``cmd`` with the hook active in it and its children; return its exit code."""
    if not (SITE_DIR / "sitecustomize.py").is_file():
        raise FileNotFoundError(f"{SITE_DIR / 'sitecustomize.py'} is missing (is refmla installed with its package data?)")
    os.makedirs(cfg.out_dir, exist_ok=True)
    proc = subprocess.Popen(list(cmd), env=capture_env(cfg))

    def forward(signum, _frame):
        try:
            proc.send_signal(signum)
        except ProcessLookupError:
            pass

    handled = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {s: signal.signal(s, forward) for s in handled}
    try:
        rc = proc.wait()
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    return 128 - rc if rc < 0 else rc


def _summary(out_dir: str, args: Optional[argparse.Namespace] = None) -> str:
    from refmla.hook.writer import folder_usage

    files, size = folder_usage(out_dir)
    line = f"refmla capture: {files} capture file(s), {size} bytes in {out_dir}"
    return line if files or args is None else f"{line}\n{why_nothing(args)}"


def why_nothing(args: argparse.Namespace) -> str:
    """What can keep a run from writing any capture, with the options in effect."""
    return "\n".join([
        "refmla capture: nothing was captured; the possible reasons, with this run's options:",
        f"  filters: no call matched --modes {args.modes} --layers {args.layers} --ranks {args.ranks} "
        f"--backends {args.backends} --every {args.every}, or no request reached --min-seq-len {args.min_seq_len}",
        "  modes: MTP / EAGLE verify calls need --modes decode,verify (the default captures decode only)",
        "  graphs: decode replayed from a CUDA/HIP graph runs no Python: launch SGLang with --disable-cuda-graph",
        f"  budget: --max-files {args.max_files} / --max-bytes {args.max_bytes} (a capture larger than the bytes is not written)",
        "  hook not installed: the server's Python must import refmla (pip install --no-deps -e /path/to/refmla); "
        "look for '[refmla.hook' lines on the server's stderr",
    ])  # fmt: skip


def _names(text: str) -> frozenset[str]:
    return frozenset(n.strip() for n in text.split(",") if n.strip())


# the highest id a range option may name, plus one: a model has at most a few hundred layers
# (DeepSeek-V3 61), a server at most a few thousand ranks; an id past these names nothing to capture
ID_LIMITS = {"--layers": 1 << 12, "--ranks": 1 << 16}


def _ids(text: str, name: str) -> Optional[IdSet]:
    """parse_int_set, bounded: an id at or past ID_LIMITS[name] is a usage error (it captures nothing)."""
    ids = parse_int_set(text, name)
    if ids is not None and ids.ranges and ids.ranges[-1][1] >= ID_LIMITS[name]:
        raise ConfigError(f"{name}={text.strip()!r}: id {ids.ranges[-1][1]} is past {ID_LIMITS[name] - 1}, "
                          f"the highest id {name[2:]} can have")  # fmt: skip
    return ids


def config_from_args(args) -> HookConfig:
    """The HookConfig that ``capture run``'s options describe; ConfigError when one cannot be parsed."""
    if not args.out.strip():  # abspath("") is the working directory: never by accident
        raise ConfigError(f"--out {args.out!r} is empty: name the output folder")
    cfg = HookConfig(
        out_dir=os.path.abspath(args.out),
        layers=_ids(args.layers, "--layers"),
        modes=_names(args.modes),
        min_seq_len=args.min_seq_len,
        ranks=_ids(args.ranks, "--ranks"),
        backends=_names(args.backends),
        every=args.every,
        max_files=args.max_files,
        max_bytes=parse_bytes(args.max_bytes, "--max-bytes"),
        partials=not args.no_partials,
    )
    HookConfig.from_env(cfg.to_env())  # the child parses the same text: fail here, not there
    return cfg


def _error(message: str) -> int:
    print(f"refmla: error: capture run: {message}", file=sys.stderr)
    return 2


def cmd_capture_run(args) -> int:
    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        return _error("no command given (refmla capture run [options] -- COMMAND...)")
    try:
        cfg = config_from_args(args)
    except ConfigError as e:
        return _error(str(e))
    try:
        rc = run_with_capture(cmd, cfg)
    except (FileNotFoundError, PermissionError) as e:
        return _error(str(e))
    print(_summary(cfg.out_dir, args), file=sys.stderr)
    return rc


def add_capture_parser(subparsers) -> argparse.ArgumentParser:
    """Add ``capture`` (with ``run``) to the refmla command line; handlers return an exit code."""
    c = subparsers.add_parser("capture", help="capture attention calls from a live SGLang server")
    csub = c.add_subparsers(dest="capture_command", required=True)
    r = csub.add_parser(
        "run",
        help="run a command (e.g. python -m sglang.launch_server ...) with the capture hook active",
        description="Run COMMAND with refmla's capture hook in it and in every Python process it starts. "
        "Decode replayed from CUDA/HIP graphs is invisible to the hook: launch SGLang with --disable-cuda-graph.",
    )
    r.add_argument("--out", default="refmla-captures", help="output folder (REFMLA_CAPTURE_DIR; default ./refmla-captures)")
    r.add_argument("--layers", default="all", help="layer ids, e.g. 0,3,10-12 (default all)")
    r.add_argument("--modes", default="decode", help="any of decode, extend, verify, comma-separated (default decode)")
    r.add_argument("--min-seq-len", type=int, default=64, help="capture only calls whose longest request has this many tokens (64)")
    r.add_argument("--ranks", default="all", help="TP ranks that capture, e.g. 0 (default all)")
    r.add_argument("--backends", default="triton,aiter", help="SGLang backends to wrap (default triton,aiter)")
    r.add_argument("--every", type=int, default=1, help="capture every N-th forward pass of a layer (1)")
    r.add_argument("--max-files", type=int, default=128, help="stop after this many captures in the folder (128)")
    r.add_argument("--max-bytes", default="4G", help="stop before the folder's captures exceed this size (4G)")
    r.add_argument("--no-partials", action="store_true", help="leave out Triton's attn_logits / attn_lse")
    r.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- COMMAND", help="the command to run")
    r.set_defaults(func=cmd_capture_run)
    return c
