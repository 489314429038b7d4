#!/usr/bin/env bash
# Set up oMLX with its test dependencies and run the whole test suite. Arguments go to pytest.
# -rfEs: the summary names each failure, error and skip with its reason. OMLX_TESTS_NO_SKIP=1
# (CI sets it) makes a skip fail unless the test may skip (tests/support/no_skip.py).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
.venv/bin/ruff check omlx tests
exec .venv/bin/python -m pytest -q -rfEs "$@"
