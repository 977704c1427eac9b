#!/usr/bin/env bash
# Command 2: set up the environment (once) and run the test suite.
#   ./run_tests.sh              all tests except the slow suite
#   ./run_tests.sh -m slow      the slow suite (full parallelism matrix)
#   ./run_tests.sh tests/test_config.py -k bool    any pytest arguments
# Tests run in two pytest processes, a test file in each at a time (pytest-xdist): the suite's
# torchrun jobs leave a core idle while they start and wait. TEST_WORKERS=0 runs them in this
# process (one at a time), TEST_WORKERS=N in N processes.
set -euo pipefail
cd "$(dirname "$0")"
source helpers/setup_env.sh
exec python -m pytest -n "${TEST_WORKERS:-2}" --dist loadfile "$@"
