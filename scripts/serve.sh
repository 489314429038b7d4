#!/usr/bin/env bash
# Set up oMLX and start the server (on the built-in default model when the model dir is empty).
# Any arguments are passed to `omlx serve`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/omlx serve "$@"
