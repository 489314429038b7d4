#!/usr/bin/env bash
# The test suite's GPU-relevant part on an NVIDIA GPU, in five parallel groups (each test
# module starts its own `omlx serve`, and each new process compiles its CUDA kernels: one
# after the other they take over 500 s on an H200). Usage: bash benchmarks/gpu/run_gpu_tests.sh LOGDIR
# Left out: the tests that need real weights (SmolLM2, all-MiniLM-L6-v2), which a lent GPU
# machine without network cannot fetch.
set -uo pipefail
cd "$(dirname "$0")/../.."
logs=${1:-/tmp/omlx-gpu-tests}
mkdir -p "$logs"
run() {  # group name, then pytest arguments
  local name=$1; shift
  python3 -m pytest -q -p no:cacheprovider "$@" >"$logs/$name.log" 2>&1
  echo "$name: $(tail -n 1 "$logs/$name.log")"
}
run gpu-openai tests/gpu tests/integration/test_openai_api.py &
run prefix-cache tests/integration/test_prefix_cache.py &
run unit tests/unit &
run servers tests/integration/test_engine_pool.py tests/integration/test_agent_apis.py \
  tests/integration/test_cli.py tests/integration/test_server_options.py &
run robustness tests/integration/test_bad_input.py tests/integration/test_disconnects.py \
  tests/integration/test_memory_admission.py tests/integration/test_long_context.py &
wait
! grep -l -E "^(FAILED|ERROR)" "$logs"/*.log
