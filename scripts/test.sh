#!/usr/bin/env bash
# Set up oMLX with its test dependencies and run the whole test suite. Arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
.venv/bin/ruff check omlx tests
exec .venv/bin/python -m pytest -q "$@"
