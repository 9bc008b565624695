#!/usr/bin/env bash
# Run the triton backend's tests against an older SGLang, one that still keeps the decode kernel
# at the pre-0.5.16 path (sglang.srt.layers.attention.triton_ops.decode_attention) with an older
# signature, so both import paths and signatures stay covered (issue 3). make test covers 0.5.23.
#
#   tools/check_sglang_versions.sh                 # SGLang 0.5.15, triton 3.9.0, all triton tests
#   SGLANG_VERSION=0.5.14 TRITON_VERSION=3.4.0 NUMPY_VERSION=1.26.4 tools/check_sglang_versions.sh
#   PYTEST_ARGS="-k 'reference and bf16'" tools/check_sglang_versions.sh   # a shorter smoke run
#   SGLANG_VERSION=0.5.6 EXTRA_PIP=fastapi tools/check_sglang_versions.sh  # no k_scale/page_size yet
#
# The venv goes to $VENV (default /tmp/refmla-sglang-$SGLANG_VERSION) and is reused when present.
# Installs: torch==2.13.0 (CPU), tools/requirements-sglang-cpu.txt, triton==$TRITON_VERSION, and
# sglang==$SGLANG_VERSION with --no-deps. The interpreters of triton 3.4-3.6 need numpy < 2
# (they call int() on one-element arrays, an error in numpy 2.4): set NUMPY_VERSION=1.26.4 there.
#
# torchvision: SGLang up to 0.5.15 imports torchvision.io.decode_jpeg at the top of
# sglang/srt/utils/common.py, which the kernel module imports. PyPI's torchvision wheels are
# built against CUDA torch and fail to load next to the CPU torch, and the decode kernel never
# calls it, so when `import torchvision` fails this script writes a two-file stand-in into the
# throwaway venv only (never into the project). Measured on 2 cores: fresh venv ~1-2 min,
# tests ~1-1.5 min.
set -euo pipefail

SGLANG_VERSION="${SGLANG_VERSION:-0.5.15}"
TRITON_VERSION="${TRITON_VERSION:-3.9.0}"
NUMPY_VERSION="${NUMPY_VERSION:-}"
EXTRA_PIP="${EXTRA_PIP:-}"  # packages an older SGLang's kernel module imports besides ours
VENV="${VENV:-/tmp/refmla-sglang-$SGLANG_VERSION}"
PYTHON="${PYTHON:-python3}"
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PYTEST_ARGS="${PYTEST_ARGS:-}"

start=$(date +%s)
if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
"${PIP[@]}" torch==2.13.0 safetensors pytest
"${PIP[@]}" -r "$ROOT/tools/requirements-sglang-cpu.txt"
"${PIP[@]}" "triton==$TRITON_VERSION"
if [ -n "$NUMPY_VERSION" ]; then "${PIP[@]}" "numpy==$NUMPY_VERSION"; fi
# shellcheck disable=SC2086
if [ -n "$EXTRA_PIP" ]; then "${PIP[@]}" $EXTRA_PIP; fi
"${PIP[@]}" --no-deps "sglang==$SGLANG_VERSION"

if ! "$VENV/bin/python" -c "import torchvision" >/dev/null 2>&1; then
    site="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    "$VENV/bin/python" -m pip uninstall -q -y torchvision >/dev/null 2>&1 || true
    mkdir -p "$site/torchvision"
    cat >"$site/torchvision/__init__.py" <<'EOF'
"""Stand-in written by refmla's tools/check_sglang_versions.sh: old SGLang imports
torchvision.io.decode_jpeg at module level; the Triton decode kernel never uses it."""
__version__ = "0.0.0+refmla-stand-in"
EOF
    cat >"$site/torchvision/io.py" <<'EOF'
def decode_jpeg(*args, **kwargs):
    raise RuntimeError("torchvision stand-in (refmla version check): decode_jpeg is unavailable")
EOF
    echo "torchvision: stand-in written to $site/torchvision (PyPI's wheels need CUDA torch)"
fi
installed=$(date +%s)

cd "$ROOT"
"$VENV/bin/python" - <<'EOF'
from refmla.backends import triton_interp
print("interpreter:", triton_interp.ensure_interpreter())
import inspect
import triton
from refmla.backends.triton import TritonBackend, locate_decode_kernel
fn, path, version = locate_decode_kernel()
print(f"sglang {version}: {path}.{fn.__name__}, triton {triton.__version__}")
print("signature:", inspect.signature(fn))
print("availability:", TritonBackend().availability())
EOF
eval "set -- $PYTEST_ARGS"
"$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/test_triton_backend.py "$@"
end=$(date +%s)
echo "sglang $SGLANG_VERSION / triton $TRITON_VERSION: install $((installed - start)) s, tests $((end - installed)) s, total $((end - start)) s"
